"""Scaling study: iteration time over world size and model size, against no communication.

Run from the repository root (about 3 minutes on a 2-core machine; wait until the machine is
otherwise idle):

    python -m benchmarks scaling

    python -m benchmarks scaling --backend nccl   # GPUs; skips cleanly without

(exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.scaling [--backend nccl]``). This study is a
launcher: for each world size (``--world-sizes``, default 1 2 4) it starts
``torchrun --standalone --nproc-per-node W -m benchmarks.studies.scaling`` in worker mode. Each worker trains a
stack of four square ``Linear`` layers of each size (``--sizes`` in millions of parameters,
default 1 10 30 100; batch 16, SGD without momentum) under three contenders, interleaved
(lib/common.py's [Note: how an iteration is timed]): gradsync's DDP and torch's DDP with default
arguments, and the bare module (no communication, the bound). Big models get fewer
iterations. Exposed communication = median minus the no-communication median.

With gloo on CPU the ranks share the machine's cores: 4 ranks on a 2-core machine are
oversubscribed, and the no-communication bound itself slows as ranks are added.
With ``--backend nccl`` each rank drives one GPU; world sizes above the GPU count are
skipped, and without a GPU the script prints why and exits 0.
Writes ``benchmarks/results/YYYY-MM-DD-scaling[-nccl].md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lib import launch, link
from benchmarks.lib.common import (
    TORCH_DDP,
    Contender,
    MachineLoad,
    interleave,
    report_path,
    revision,
    summarise,
    today,
    train_step,
)
from gradsync import DistributedDataParallel as GradsyncDDP

CONTENDERS = ("gradsync", "torch_ddp", "no_comm")
DEPTH, BATCH = 4, 16


def linear_stack(million_params: float) -> nn.Module:
    width = round(math.sqrt(million_params * 1e6 / DEPTH))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(DEPTH)])


def schedule(million_params: float) -> tuple[int, int, int]:
    """(warm-up, rounds, iterations per round): fewer for big models, to keep the run short."""
    if million_params >= 50:
        return 2, 3, 2
    if million_params >= 20:
        return 3, 4, 3
    return 3, 5, 5


# ---------------------------------------------------------------------- worker (under torchrun)
def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    load = MachineLoad()
    load.start()
    results = {}
    for size in args.sizes:
        results[str(size)] = measure(size, device)
        gc.collect()
    load.stop()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"results": results, "load": load.describe()}))
    dist.barrier()
    dist.destroy_process_group()


def measure(size: float, device: torch.device) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    torch.manual_seed(0)
    base = linear_stack(size).to(device)
    width = base[0].in_features
    batches = [
        (
            torch.randn(BATCH, width, generator=generator).to(device),
            torch.randn(BATCH, width, generator=generator).to(device),
        )
        for _ in range(2)
    ]
    runs = []
    for name in CONTENDERS:
        model = wrap(name, copy.deepcopy(base), device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        step = train_step(model, optimizer, nn.functional.mse_loss, batches)
        if device.type == "cuda":
            step = synchronized(step)
        run = Contender(name, step)
        run.rest = lambda optimizer=optimizer: optimizer.zero_grad(set_to_none=True)  # free .grad between blocks
        runs.append(run)
    del base
    warmup, rounds, iters = schedule(size)
    samples = interleave(runs, rounds, iters, warmup)
    runs.clear()
    return {
        "params": DEPTH * (width * width + width),
        "width": width,
        "rounds": rounds,
        "iters": iters,
        "samples": samples,
    }


def wrap(name: str, module: nn.Module, device: torch.device) -> nn.Module:
    ids = [device] if device.type == "cuda" else None
    if name == "gradsync":
        return GradsyncDDP(module, device_ids=ids)
    if name == "torch_ddp":
        return TORCH_DDP(module, device_ids=ids)
    return module


def synchronized(step: Any) -> Any:
    def run(i: int) -> None:
        step(i)
        torch.cuda.synchronize()

    return run


# ---------------------------------------------------------------------- launcher and report
def launch_world(world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        worker = ["--worker", "--backend", args.backend, "--out", str(out)]
        worker += ["--sizes", *[str(s) for s in args.sizes]]
        env = launch.env(OMP_NUM_THREADS="1")
        module = launch.main_module()  # workers are this study in worker mode ([Note: one way to start a study])
        if args.per_rank_links:  # one namespace and link per rank ([Note: one link per rank] in link.py)
            status = link.run_ranks(args.link, world_size, launch.python_m(module, worker), env)
            if status != 0:
                raise SystemExit(f"{world_size} ranks on per-rank links failed with status {status}")
        else:
            subprocess.run(launch.torchrun_m(module, worker, nproc=world_size), check=True, env=env)
        return json.loads(out.read_text())


def wire_mb(nbytes: int, world: int) -> float:
    """MB each rank sends per all-reduce of ``nbytes`` with gloo's ring algorithm: 2 (W - 1) / W of it."""
    return 2 * (world - 1) / world * nbytes / 1e6 if world > 1 else 0.0


def table(runs: dict[int, dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | parameters (M) | gradients MiB | MB on the wire / rank / iteration | no_comm ms "
        "| gradsync ms (p90) | torch_ddp ms (p90) "
        "| gradsync exposed ms | torch exposed ms | gradsync / no_comm | gradsync / torch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, run in runs.items():
        for result in run["results"].values():
            s = {name: summarise(times) for name, times in result["samples"].items()}
            floor, ours, theirs = s["no_comm"].median_ms, s["gradsync"], s["torch_ddp"]
            lines.append(
                f"| {world} | {result['params'] / 1e6:.1f} | {result['params'] * 4 / 2**20:.0f} "
                f"| {wire_mb(result['params'] * 4, world):.1f} | {floor:.1f} "
                f"| {ours.median_ms:.1f} ({ours.p90_ms:.1f}) | {theirs.median_ms:.1f} ({theirs.p90_ms:.1f}) "
                f"| {ours.median_ms - floor:.1f} | {theirs.median_ms - floor:.1f} "
                f"| {ours.median_ms / floor:.2f} | {ours.median_ms / theirs.median_ms:.2f} |"
            )
    return lines


def chart(runs: dict[int, dict[str, Any]], path: Path, backend: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = {"gradsync": "-o", "torch_ddp": ":s", "no_comm": "--x"}
    for k, (world, run) in enumerate(runs.items()):
        color = f"C{k}"
        results = list(run["results"].values())
        params = [r["params"] / 1e6 for r in results]
        medians = {n: [summarise(r["samples"][n]).median_ms for r in results] for n in CONTENDERS}
        for name, style in styles.items():
            left.plot(params, medians[name], style, color=color, label=f"{name}, {world} ranks")
        for name in ("gradsync", "torch_ddp"):
            exposed = [max(m - f, 1e-2) for m, f in zip(medians[name], medians["no_comm"])]
            right.plot(params, exposed, styles[name], color=color, label=f"{name}, {world} ranks")
    for ax, title in ((left, "median iteration time"), (right, "exposed communication (median - no_comm)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"gradsync scaling, {backend} ({today()})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(runs: dict[int, dict[str, Any]], args: argparse.Namespace, skipped: list[str]) -> Path:
    suffix = "" if args.backend == "gloo" else f"-{args.backend}"
    png = report_path(f"scaling{suffix}", "png")
    command = "python -m benchmarks scaling" + ("" if args.backend == "gloo" else f" --backend {args.backend}")
    command += " --world-sizes " + " ".join(str(w) for w in args.world_sizes)
    command += " --sizes " + " ".join(f"{s:g}" for s in args.sizes)
    command += f" --link {args.link}" if args.link else ""
    command += " --per-rank-links" if args.per_rank_links else ""
    device = "CPU" if args.backend == "gloo" else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    lines = [
        f"# Scaling: world size and model size ({today()})",
        "",
        f"Command: `{command}`",
        "",
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}, commit {revision()}",
        f"- backend {args.backend} on {device}, {os.cpu_count()} CPU cores, torch threads per rank 1",
        f"- link: {link.describe(args.link, True) if args.per_rank_links else link.describe()}",
        f"- model: {DEPTH} x Linear(w, w), batch {BATCH} per rank, MSE loss, SGD without momentum; "
        "contenders gradsync and torch DDP (default arguments) and no_comm (the bare module), interleaved",
        "- iterations: 5 rounds x 5 below 20 M parameters, 4 x 3 below 50 M, 3 x 2 above; time = slowest rank's",
    ]
    if args.backend == "gloo":
        lines.append(
            f"- {os.cpu_count()} cores: 4 ranks oversubscribe them, so at 4 ranks compute and communication "
            "fight for cores and even no_comm slows down; 1 rank still runs the all-reduces (on a one-rank group)"
        )
    lines += [f"- machine load, {world} ranks: {run['load']}" for world, run in runs.items()]
    lines += [f"- skipped: {s}" for s in skipped]
    lines += ["", f"![scaling]({png.name})", "", *table(runs), ""]
    chart(runs, png, args.backend)
    path = report_path(f"scaling{suffix}")
    path.write_text("\n".join(lines))
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1, 10, 30, 100], help="millions of parameters")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--link",
        help="rate of a shaped loopback link (1gbit, 10gbit, ...): the whole study runs inside it (lib/link.py)",
    )
    parser.add_argument(
        "--per-rank-links",
        action="store_true",
        help="with --link: each rank behind its own link of that rate to a switch, not one shared loopback",
    )
    args = parser.parse_args()
    if args.per_rank_links and not args.link:
        parser.error("--per-rank-links needs --link RATE")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    link.enter_launcher(args.link, args.per_rank_links)  # with --link: reruns this launcher inside a namespace
    world_sizes, skipped = list(args.world_sizes), []
    if args.backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            print("scaling --backend nccl: no CUDA GPU on this machine; nothing to measure, skipping.")
            return 0
        skipped = [f"{w} ranks (only {gpus} GPUs)" for w in world_sizes if w > gpus]
        world_sizes = [w for w in world_sizes if w <= gpus]
    runs = {}
    for world in world_sizes:
        print(f"--- {world} ranks", flush=True)
        runs[world] = launch_world(world, args)
    path = write_report(runs, args, skipped)
    print(path.read_text())
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
