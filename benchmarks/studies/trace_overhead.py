"""Cost of gradsync's observability: tracing off vs on, desync mode, divergence checks.

Run from the repository root::

    python -m benchmarks trace_overhead

which is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.trace_overhead``.

Four settings of one gradsync DDP on ``mlp_many_small`` (200 x Linear(64, 64), 400
parameter tensors), measured interleaved over rounds: plain, inside ``gradsync.trace``,
with ``enable_divergence_check(every=100)``, and in desync mode. Rank 0 writes
``benchmarks/results/YYYY-MM-DD-observability.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from benchmarks.lib import launch
from benchmarks.lib.common import report_path
from gradsync import DistributedDataParallel as DDP

ROUNDS, ITERS = 7, 20


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(200)])


def step(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


def timed(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        step(ddp, opt, x, y)
    elapsed = torch.tensor([(time.perf_counter() - start) / ITERS])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    settings = {name: DDP(build()) for name in ("off", "trace", "divergence_every_100", "desync")}
    settings["divergence_every_100"].enable_divergence_check(every=100)
    settings["desync"].enable_desync_detection()
    opts = {name: torch.optim.SGD(d.parameters(), lr=1e-3) for name, d in settings.items()}
    times: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for name, ddp in settings.items():
            step(ddp, opts[name], x, y)
            step(ddp, opts[name], x, y)
        for _ in range(ROUNDS):
            for name, ddp in settings.items():
                if name == "trace":
                    with gradsync.trace(ddp, os.path.join(tmp, "trace.json")):
                        times[name].append(timed(ddp, opts[name], x, y))
                else:
                    times[name].append(timed(ddp, opts[name], x, y))
    if rank == 0:
        base = statistics.median(times["off"])
        lines = [
            f"# Cost of observability ({datetime.date.today()})",
            "",
            f"Command: `{launch.command_line()}`",
            "",
            f"- torch {torch.__version__}, world size {dist.get_world_size()}, gloo, CPU, 1 thread per rank",
            f"- mlp_many_small (400 parameter tensors), {ROUNDS} rounds x {ITERS} iterations, interleaved",
            f"- load average at the end: {open('/proc/loadavg').read().split()[:3]}",
            "",
            "| setting | median ms / iteration | vs off |",
            "|---|---:|---:|",
        ]
        for name, values in times.items():
            median = statistics.median(values)
            lines.append(f"| {name} | {median:.2f} | {median / base:.3f} |")
        path = report_path("observability")  # results/YYYY-MM-DD-observability.md, or GRADSYNC_BENCH_RESULTS
        path.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
