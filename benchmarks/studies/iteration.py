"""Time one training iteration: gradsync's DDP against torch's DDP and against no communication.

Run from the repository root (what ``make bench`` does):

    python -m benchmarks iteration

which is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.iteration``.

An iteration is zero_grad, forward, loss, backward, optimizer step. Three contenders
start from the same weights: ``gradsync`` (gradsync's DDP, default arguments),
``torch_ddp`` (``torch.nn.parallel.DistributedDataParallel``, default arguments) and
``no_comm`` (the bare module; each rank trains alone). ``no_comm`` is the floor: a
contender's time above it is communication the backward pass did not hide.

Contenders run interleaved (A B C, B C A, ...) in rounds, so drift (thermal, other load)
hits them all alike (see lib/common.py). An iteration's time is the slowest rank's, since a step is only
done when every rank is. Rank 0 writes ``benchmarks/results/YYYY-MM-DD-iteration.md``. The workloads live in
``lib/workloads.py``; the ``suite`` study runs all of them against more contenders.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from benchmarks.lib import launch
from benchmarks.lib.common import (
    TORCH_DDP,
    Contender,
    interleave,
    processor,
    report_path,
    revision,
    summarise,
    train_step,
)
from benchmarks.lib.workloads import WORKLOADS as ALL_WORKLOADS
from benchmarks.lib.workloads import Workload, gradient_size
from gradsync import DistributedDataParallel as GradsyncDDP

BATCHES_PER_RANK = 4  # distinct batches cycled through, so no iteration sees stale caches only
CONTENDERS = ("gradsync", "torch_ddp", "no_comm")
WORKLOADS = {name: ALL_WORKLOADS[name] for name in ("mlp_many_small", "cnn_bn")}  # the full set: the suite


# ---------------------------------------------------------------------- measurement
def make_contenders(workload: Workload, batches: list) -> list[Contender]:
    torch.manual_seed(0)  # same weights on every rank and for every contender
    base = workload.build()
    wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {
        "gradsync": GradsyncDDP,
        "torch_ddp": TORCH_DDP,
        "no_comm": lambda module: module,
    }
    contenders = []
    for name in CONTENDERS:
        model = wrappers[name](copy.deepcopy(base))
        # A small learning rate: the weights must stay finite, their values do not matter.
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        contenders.append(Contender(name, train_step(model, optimizer, workload.loss, batches)))
    return contenders


def measure(workload: Workload, args: argparse.Namespace) -> dict[str, list[float]]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    batches = [workload.make_batch(generator) for _ in range(BATCHES_PER_RANK)]
    contenders = make_contenders(workload, batches)
    samples = interleave(contenders, args.rounds, args.iters, args.warmup)
    # Both DDPs hold reference cycles; free them now, not at interpreter exit after the
    # process group is gone (torch's DDP then sometimes aborts: "terminate called ...").
    contenders.clear()
    gc.collect()
    return samples


# ---------------------------------------------------------------------- report
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


def gradient_description(workload: Workload) -> str:
    tensors, _, nbytes = gradient_size(workload)
    return f"{tensors} parameter tensors, {nbytes / 2**20:.2f} MiB of gradients"


def write_report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> Path:
    today = datetime.date.today().isoformat()
    lines = [
        f"# Iteration time: gradsync vs torch DDP ({today})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {revision()})",
        f"- world size {dist.get_world_size()}, backend {dist.get_backend()}, CPU only, "
        f"{os.cpu_count()} CPU cores on the machine, torch threads per rank {torch.get_num_threads()}",
        f"- {platform.platform()}; {processor()}",
        f"- {args.warmup} warm-up iterations per contender, then {args.rounds} rounds x {args.iters} "
        "iterations, contenders interleaved within each round (starting contender rotating)",
        "- iteration = zero_grad, forward, loss, backward, SGD step; its time is the slowest rank's",
        "- both DDPs use their default arguments (25 MiB buckets, 1 MiB first bucket, buffers broadcast every forward)",
        "- the two ranks share the machine's cores with gloo's threads, so `no_comm` is not free of "
        "contention either; p90 shows how noisy a workload was",
        "",
        "Workloads:",
        "",
    ]
    lines += [f"- `{name}`: {WORKLOADS[name].description}; {gradient_description(WORKLOADS[name])}" for name in results]
    lines += ["", *table(results), ""]
    path = report_path("iteration")
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
