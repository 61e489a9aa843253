"""Compression on a real task: does a comm hook keep the accuracy, and what does a step cost?

Run from the repository root (about 2 minutes; on a shaped link, as root):

    python -m benchmarks compression_task --link 1gbit
    python -m benchmarks compression_task   # loopback

The first is exactly ``python -m benchmarks.studies.compression_task --link 1gbit`` (it starts torchrun
inside the namespace itself), the second
``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.compression_task``.

The task is scikit-learn's handwritten digits (shipped with the package: no download), the
demo's data (examples/train_digits.py), with a wider MLP (64-512-512-10, 0.30 M parameters) so
that its gradients are worth compressing. Every contender starts from the same weights, sees
the same batches in the same order (a DistributedSampler per epoch, batch 32 per rank) and trains
the same number of steps with SGD (lr 0.05, momentum 0.9); contenders run one after the other,
each timed over its whole run (the slowest rank's step time, without evaluation). Reported per
contender: the median step time, the final training loss (mean of the last epoch, averaged over
ranks), the test accuracy after the last step, and the loss curve (PNG).

Contenders: torch DDP (default, + fp16_compress_hook, + powerSGD_hook rank 2 with one bucket:
torch's deadlocks on gloo with several), gradsync (default, PowerSGD ranks 1, 2, 4, int8, top-k
1% and bf16, each with its error feedback where it has one). PowerSGD starts compressing at
step 10 (torch's requires start_powerSGD_iter > 1), the same for both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.lib import launch, link
from benchmarks.lib.common import TORCH_DDP, environment_lines, report_path, today
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import hooks

SEED, LR, MOMENTUM, BATCH = 0, 0.05, 0.9, 32
START_ITER = 10
TorchDDP = TORCH_DDP  # torch's own class, even under GRADSYNC_INSTALL=1


def load_splits() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _gradsync(state: Callable[[], Any] | None = None, hook: Any = None) -> Callable[[nn.Module], nn.Module]:
    def wrap(module: nn.Module) -> nn.Module:
        ddp = GradsyncDDP(module)
        if hook is not None:
            ddp.register_comm_hook(state() if state else None, hook)
        return ddp

    return wrap


def _torch(state: Callable[[], Any] | None = None, hook: Any = None, **kwargs: Any) -> Callable[[nn.Module], nn.Module]:
    def wrap(module: nn.Module) -> nn.Module:
        ddp = TorchDDP(module, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(state() if state else None, hook)
        return ddp

    return wrap


def _gradsync_powersgd(rank: int) -> Callable[[nn.Module], nn.Module]:
    return _gradsync(lambda: hooks.PowerSGDState(None, matrix_approximation_rank=rank, start_iter=START_ITER),
                     hooks.powersgd_hook)  # fmt: skip


CONTENDERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "torch DDP default": _torch(),
    "torch DDP + fp16_compress_hook": _torch(None, default_hooks.fp16_compress_hook),
    "torch DDP + powerSGD_hook r=2 (one bucket)": _torch(
        lambda: torch_powersgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=START_ITER),
        torch_powersgd.powerSGD_hook,
        bucket_cap_mb=1024,
    ),
    "gradsync default": _gradsync(),
    "gradsync powersgd_hook r=1": _gradsync_powersgd(1),
    "gradsync powersgd_hook r=2": _gradsync_powersgd(2),
    "gradsync powersgd_hook r=4": _gradsync_powersgd(4),
    "gradsync int8_hook": _gradsync(lambda: hooks.Int8State(None), hooks.int8_hook),
    "gradsync topk_hook 1%": _gradsync(lambda: hooks.TopKState(None, ratio=0.01), hooks.topk_hook),
    "gradsync bf16_compress_hook": _gradsync(None, hooks.bf16_compress_hook),
}


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(name: str, train_set: TensorDataset, test_set: TensorDataset, epochs: int) -> dict[str, Any]:
    module = make_model()
    model = CONTENDERS[name](module)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sampler = DistributedSampler(train_set, seed=SEED)
    losses, step_times = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train_set, batch_size=BATCH, sampler=sampler):
            dist.barrier()  # each step timed from a common start: the slowest rank's time
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            elapsed = torch.tensor([time.perf_counter() - start, loss.item()], dtype=torch.float64)
            dist.all_reduce(elapsed)
            step_times.append(elapsed[0].item() / dist.get_world_size())
            losses.append(elapsed[1].item() / dist.get_world_size())
    steps_per_epoch = len(losses) // epochs
    return {
        "losses": losses,
        "median_step_ms": statistics.median(step_times) * 1e3,
        "final_loss": statistics.fmean(losses[-steps_per_epoch:]),
        "accuracy": accuracy(module, test_set),
    }


def write_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    reference = results["torch DDP default"]
    chart = report_path("compression-task", "png")
    command = launch.command_line()
    lines = [
        f"# Compression on a real task: digits, {args.epochs} epochs ({today()})",
        "",
        *environment_lines(command),
        "",
        "The method is in the script's docstring. Step time: median over all steps of the slowest rank's; "
        "loss: cross-entropy averaged over ranks, mean of the last epoch; accuracy: on the 450 held-out digits "
        "after the last step.",
        "",
        f"![loss curves]({chart.name})",
        "",
        "| contender | median step ms | vs torch DDP default | final loss | vs torch default | test accuracy | "
        "points vs torch default |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['median_step_ms']:.2f} | {r['median_step_ms'] / reference['median_step_ms']:.2f} "
            f"| {r['final_loss']:.4f} | {r['final_loss'] / reference['final_loss']:.2f} | {r['accuracy']:.4f} "
            f"| {100 * (r['accuracy'] - reference['accuracy']):+.1f} |"
        )
    path = report_path("compression-task")
    path.write_text("\n".join(lines) + "\n")
    _chart(results, chart)
    print(path.read_text())
    print(f"report: {path}")


def _chart(results: dict[str, dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        smooth = [statistics.fmean(r["losses"][max(0, i - 10) : i + 1]) for i in range(len(r["losses"]))]
        ax.plot(smooth, label=name, linewidth=1.2, linestyle="--" if name.startswith("torch") else "-")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of ranks, 11-step moving average)")
    ax.set_title(f"digits: loss curves per comm hook ({link.current() or 'plain loopback'})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--link", help="rate of a shaped loopback link (1gbit, ...): start with python (lib/link.py)")
    args = parser.parse_args()
    link.enter(args.link, nproc=2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_set, test_set = load_splits()
    results = {}
    for name in CONTENDERS:
        results[name] = train(name, train_set, test_set, args.epochs)
        if dist.get_rank() == 0:
            print(f"{name}: {results[name]['median_step_ms']:.2f} ms, accuracy {results[name]['accuracy']:.4f}")
    if dist.get_rank() == 0:
        write_report(results, args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
