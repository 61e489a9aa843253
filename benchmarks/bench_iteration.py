"""Time one training iteration: gradsync's DDP against torch's DDP and against no communication.

Run (what ``make bench`` does):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_iteration.py

An iteration is zero_grad, forward, loss, backward, optimizer step. Three contenders
start from the same weights: ``gradsync`` (gradsync's DDP, default arguments),
``torch_ddp`` (``torch.nn.parallel.DistributedDataParallel``, default arguments) and
``no_comm`` (the bare module; each rank trains alone). ``no_comm`` is the floor: a
contender's time above it is communication the backward pass did not hide.

Contenders run interleaved (A B C A B C ...) in rounds, so drift (thermal, other load)
hits them all alike. An iteration's time is the slowest rank's, since a step is only
done when every rank is. Rank 0 writes ``benchmarks/results/YYYY-MM-DD-iteration.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BATCHES_PER_RANK = 4  # distinct batches cycled through, so no iteration sees stale caches only
CONTENDERS = ("gradsync", "torch_ddp", "no_comm")

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def many_small_linears(layers: int = 200, width: int = 64) -> nn.Module:
    # Hundreds of tiny parameters: stresses per-parameter overhead (hooks, copies), not bandwidth.
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    return nn.Sequential(*blocks)


class BasicBlock(nn.Module):
    """ResNet's two-conv residual block; a strided 1x1 conv matches shapes when needed."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN for 32x32 images: 16 -> 32 -> 64 channels, two blocks per stage."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        stages = []
        c_in = 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            stages += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


WORKLOADS = {
    "mlp_many_small": Workload(
        "mlp_many_small",
        "200 x (Linear(64, 64) + Tanh), batch 32, MSE loss",
        many_small_linears,
        lambda g: (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)),
        F.mse_loss,
    ),
    "cnn_bn": Workload(
        "cnn_bn",
        "ResNet-style CNN with BatchNorm (6 basic blocks, 16/32/64 channels), 32x32 RGB, batch 16",
        SmallResNet,
        lambda g: (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)),
        F.cross_entropy,
    ),
}


# ---------------------------------------------------------------------- measurement
@dataclass
class Contender:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer


def make_contenders(workload: Workload) -> list[Contender]:
    torch.manual_seed(0)  # same weights on every rank and for every contender
    base = workload.build()
    wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
        "gradsync": GradsyncDDP,
        "torch_ddp": nn.parallel.DistributedDataParallel,
        "no_comm": lambda module: module,
    }
    contenders = []
    for name in CONTENDERS:
        model = wrappers[name](copy.deepcopy(base))
        # A small learning rate: the weights must stay finite, their values do not matter.
        contenders.append(Contender(name, model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)))
    return contenders


def run_iterations(contender: Contender, workload: Workload, batches: list[Batch], count: int) -> list[float]:
    """Seconds per iteration on this rank."""
    times = []
    for i in range(count):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        contender.optimizer.zero_grad(set_to_none=True)
        loss = workload.loss(contender.model(x), y)
        loss.backward()  # both DDPs have waited for every all-reduce when this returns
        contender.optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def slowest_rank(times: list[float]) -> list[float]:
    """Per iteration, the maximum over ranks (one collective per round, outside the timing)."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def measure(workload: Workload, args: argparse.Namespace) -> dict[str, list[float]]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    batches = [workload.make_batch(generator) for _ in range(BATCHES_PER_RANK)]
    contenders = make_contenders(workload)
    for contender in contenders:  # warm-up includes both DDPs' bucket rebuild after iteration 1
        dist.barrier()
        run_iterations(contender, workload, batches, args.warmup)
    samples: dict[str, list[float]] = {c.name: [] for c in contenders}
    for _ in range(args.rounds):
        for contender in contenders:
            dist.barrier()  # start each block together, so no rank's head start is timed
            times = run_iterations(contender, workload, batches, args.iters)
            samples[contender.name] += slowest_rank(times)
    # Both DDPs hold reference cycles; free them now, not at interpreter exit after the
    # process group is gone (torch's DDP then sometimes aborts: "terminate called ...").
    contenders.clear()
    gc.collect()
    return samples


# ---------------------------------------------------------------------- report
@dataclass(frozen=True)
class Summary:
    median_ms: float
    p90_ms: float


def summarise(times: list[float]) -> Summary:
    ms = [t * 1e3 for t in times]
    return Summary(statistics.median(ms), statistics.quantiles(ms, n=10)[-1])


def table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = [
        "| workload | contender | median ms | p90 ms | median / torch_ddp | exposed comm ms (median - no_comm) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload, samples in results.items():
        stats = {name: summarise(times) for name, times in samples.items()}
        floor, torch_ddp = stats["no_comm"].median_ms, stats["torch_ddp"].median_ms
        for name, s in stats.items():
            ratio = f"{s.median_ms / torch_ddp:.2f}" if name != "no_comm" else "-"
            exposed = f"{s.median_ms - floor:.2f}" if name != "no_comm" else "-"
            lines.append(f"| {workload} | {name} | {s.median_ms:.2f} | {s.p90_ms:.2f} | {ratio} | {exposed} |")
    return lines


def gradient_size(workload: Workload) -> str:
    params = list(workload.build().parameters())
    mib = sum(p.numel() * p.element_size() for p in params) / 2**20
    return f"{len(params)} parameter tensors, {mib:.2f} MiB of gradients"


def gradsync_revision() -> str:
    """The commit the numbers belong to, flagged when the working tree differs from it."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=repo, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes in src/" if dirty.stdout.strip() else "")


def write_report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> Path:
    today = datetime.date.today().isoformat()
    lines = [
        f"# Iteration time: gradsync vs torch DDP ({today})",
        "",
        "Command: `OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_iteration.py`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {gradsync_revision()})",
        f"- world size {dist.get_world_size()}, backend {dist.get_backend()}, CPU only, "
        f"{os.cpu_count()} CPU cores on the machine, torch threads per rank {torch.get_num_threads()}",
        f"- {platform.platform()}",
        f"- {args.warmup} warm-up iterations per contender, then {args.rounds} rounds x {args.iters} "
        "iterations, contenders interleaved within each round",
        "- iteration = zero_grad, forward, loss, backward, SGD step; its time is the slowest rank's",
        "- both DDPs use their default arguments (25 MiB buckets, 1 MiB first bucket, buffers broadcast every forward)",
        "- the two ranks share the machine's cores with gloo's threads, so `no_comm` is not free of "
        "contention either; p90 shows how noisy a workload was",
        "",
        "Workloads:",
        "",
    ]
    lines += [f"- `{name}`: {WORKLOADS[name].description}; {gradient_size(WORKLOADS[name])}" for name in results]
    lines += ["", *table(results), ""]
    path = RESULTS_DIR / f"{today}-iteration.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=5, help="iterations per contender before timing")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10, help="iterations per contender per round")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    results = {}
    for name in args.workloads:
        start = time.perf_counter()
        results[name] = measure(WORKLOADS[name], args)
        if dist.get_rank() == 0:
            print(f"{name}: measured in {time.perf_counter() - start:.1f} s")
    if dist.get_rank() == 0:
        print("\n".join(table(results)))
        print(f"report: {write_report(results, args)}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
