"""What PowerSGD costs in CPU alone: process CPU per step over the bare module's, world size 1, several instances.

Run from the repository root (single process, a few minutes):

    python -m benchmarks hook_cpu --before HEAD --rank 1 --shapes cnn_bn_w2_b8 gpt_b4_v2k_d128_L8_tied

which is exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.hook_cpu ...``.

On loopback and on a fast link a compressing hook's step is mostly CPU: its products, its copies,
the engine around it. This study takes the link away (a gloo group of one process: every
collective moves no byte) and measures the CPU a training step costs over the bare module's, for:
this working tree's gradsync PowerSGD (``after``), the same at ``--before`` (``before``, imported
from ``git archive`` as in studies/ab.py) and torch's DDP with its ``powerSGD_hook`` (one bucket,
as in the sweep), all at rank ``--rank`` compressing from iteration 2.

It counts the CPU of every thread of the process (``time.process_time``), not the training
thread's: torch's hook runs half of each round (the ``Q`` product, the residual, the output) in
future callbacks, on gloo's threads, where the training thread's clock does not see it. Each
contender is built ``--instances`` times, in turns with the order reversed every other turn, and
every instance is timed in every round (shuffled), ``--iters`` steps a block; an instance's CPU is
the median of its blocks, and a contender's the mean over its instances, with a 90% Welch interval
for each difference ([Note: instance effects] in lib/instance_stats.py: instances of the same code
differ for a whole run). Writes ``benchmarks/results/YYYY-MM-DD-hook-cpu-rR[-LABEL].md``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.lib import launch, shapes
from benchmarks.lib.common import environment_lines, free_port, report_path, train_step
from benchmarks.lib.instance_stats import t_quantile, welch_df
from benchmarks.studies import ab, suite

KINDS = ("no_comm", "torch_ddp", "before", "after")  # ab.build's names; with --hook powersgd each has its hook
DEFAULT_SHAPES = [
    "cnn_bn_w2_b8",
    "gpt_b4_v2k_d128_L8_tied",
    "gpt_b1_v8k_d256_L2_tied",
    "gpt_b2_v8k_d256_L2_untied",
    "mlp_400x32_b64",
    "mlp_3x1024_b4",
]
WARMUP = 5
SHAPES = {shape.name: shape for shape in shapes.GRID}


def difference(ours: list[float], theirs: list[float], confidence: float = 0.90) -> tuple[float, float]:
    """Mean of ``ours`` less mean of ``theirs`` and the half-width of its Welch t interval."""
    var_a, var_b = statistics.variance(ours) / len(ours), statistics.variance(theirs) / len(theirs)
    half = t_quantile(welch_df(var_a, len(ours), var_b, len(theirs)), confidence) * math.sqrt(var_a + var_b)
    return statistics.fmean(ours) - statistics.fmean(theirs), half


def measure(shape: str, before: object, args: argparse.Namespace) -> dict[str, list[float]]:
    """Per contender, each instance's median process CPU per step in ms."""
    workload = shapes.workload(SHAPES[shape], args.iters, args.rounds)
    batches = suite.make_batches(workload)
    torch.manual_seed(0)
    base = workload.build()
    hooked = argparse.Namespace(as_view=False, hook="powersgd", rank=args.rank)
    steps: dict[tuple[str, int], Callable[[int], None]] = {}
    for k in range(args.instances):
        for kind in KINDS if k % 2 == 0 else reversed(KINDS):
            model = ab.build(kind, copy.deepcopy(base), before, hooked)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=workload.momentum)
            steps[(kind, k)] = train_step(model, optimizer, workload.loss, batches)
    for step in steps.values():
        for i in range(WARMUP):  # PowerSGD compresses from iteration 2 on
            step(i)
    blocks: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    order = random.Random(0)
    for _ in range(args.rounds):
        keys = list(steps)
        order.shuffle(keys)
        for key in keys:
            start = time.process_time()
            for i in range(args.iters):
                steps[key](i)
            blocks[key].append((time.process_time() - start) / args.iters * 1e3)
    return {kind: [statistics.median(blocks[(kind, k)]) for k in range(args.instances)] for kind in KINDS}


def report_rows(shape: str, cpu: dict[str, list[float]]) -> str:
    floor = statistics.fmean(cpu["no_comm"])
    over = {kind: [x - floor for x in cpu[kind]] for kind in KINDS[1:]}
    cells = [f"{statistics.fmean(v):.2f} ± {statistics.stdev(v) / math.sqrt(len(v)):.2f}" for v in over.values()]
    after_before, half_ab = difference(cpu["after"], cpu["before"])
    after_torch, half_at = difference(cpu["after"], cpu["torch_ddp"])
    versus_before = f"{after_before:+.2f} [{after_before - half_ab:+.2f}, {after_before + half_ab:+.2f}]"
    versus_torch = f"{after_torch:+.2f} [{after_torch - half_at:+.2f}, {after_torch + half_at:+.2f}]"
    return f"| {shape} | {floor:.1f} | {' | '.join(cells)} | {versus_before} | {versus_torch} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="git revision to compare against")
    parser.add_argument("--label", default="", help="report file suffix")
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix_approximation_rank (all three)")
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--instances", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    before = ab.import_revision(args.before, Path(tempfile.mkdtemp(prefix="gradsync-before-")))
    rows = []
    for shape in args.shapes:
        rows.append(report_rows(shape, measure(shape, before, args)))
        print(rows[-1], flush=True)
    lines = [
        f"# PowerSGD rank {args.rank}: process CPU per step over the bare module's, world size 1 "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        *(line for line in environment_lines(launch.command_line())[2:] if not line.startswith("- link")),
        f"- `--before {args.before}`: {ab.revision_line(args.before)}",
        f"- a gloo group of this process alone: collectives move no byte; {args.instances} instances of each "
        f"contender, {WARMUP} warm-up steps, {args.rounds} rounds of {args.iters} steps (shuffled); CPU of every "
        "thread of the process (`time.process_time`): torch's hook runs part of each round in callbacks on "
        "gloo's threads",
        "- per contender: mean over instances of (its median CPU per step less the bare module's mean) ± the standard "
        "error over instances; differences: 90% Welch t interval over instances",
        "",
        "| shape | bare module ms | torch's DDP + powerSGD_hook, ms over | before, ms over | after, ms over | "
        "after - before, ms | after - torch, ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    suffix = f"-{args.label}" if args.label else ""
    path = report_path(f"hook-cpu-r{args.rank}{suffix}")
    path.write_text("\n".join(lines) + "\n")
    print(f"report: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
