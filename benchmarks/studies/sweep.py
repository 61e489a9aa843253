"""The sweep: gradsync's and torch's defaults and hooks against the bound on 27 generated model shapes.

Run from the repository root (about 20 minutes at 1 Gbit/s on 2 cores):

    python -m benchmarks sweep --link 1gbit     # a shaped link (root; lib/link.py)
    python -m benchmarks sweep --link 10gbit
    python -m benchmarks sweep                  # plain loopback

The last is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.sweep``;
with ``--link`` it is ``python -m benchmarks.studies.sweep --link 1gbit``, which starts torchrun
inside the namespace itself.

The shapes (``lib/shapes.py``'s ``GRID``): GPT-like decoders (1, 2, 4 sequences of 128, vocabulary
2k-32k, width 128-512, 2-8 layers, tied and untied head), MLPs of many small and of few large layers,
and the BatchNorm conv net, spanning compute per gradient byte over two orders of magnitude. Per
shape, interleaved over rounds (lib/common.py's [Note: how an iteration is timed]): no
communication, the bound's parts (``forward_only`` and ``raw_allreduce``, the suite's, plus
``to_first_gradient``), torch's DDP and gradsync at their defaults, ``bucket_cap_mb="auto"``, gradsync's
PowerSGD at ranks 1 and 4 and torch's ``powerSGD_hook`` at the same ranks, gradsync's int8 hook
(``lib/contenders.py``), and the CPU floors ([Note: the CPU floors] below): gradsync and its PowerSGD
over a group of one rank, and the flat all-reduce's CPU time. After the rounds every contender's
weights are checked for NaN and infinities; the report marks the ones that went non-finite.
Each shape is short (``--warmup 3 --rounds 5 --iters 2``); the ratios are
per-round paired ratios with 90% bootstrap intervals (lib/sweep_stats.py). Rank 0 writes
``benchmarks/results/YYYY-MM-DD-sweep[-RATE].md`` and ``.png`` (ratio to the bound and to no
communication, against compute per byte), with issue #46's targets evaluated on the same run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradsync
from benchmarks.lib import contenders, launch, link, shapes, sweep_report, sweep_timeline
from benchmarks.lib.common import (
    Contender,
    MachineLoad,
    add_shape_study_options,
    environment_lines,
    interleave,
    report_path,
    today,
    wait_for_quiet,
)
from benchmarks.lib.workloads import gradient_size
from benchmarks.studies import suite

CONTENDERS = sweep_report.CONTENDERS


def gradsync_timing(run: Any) -> tuple[int, float, float]:
    stats = run.model.stats()
    return stats.iterations, stats.avg_comm_s * stats.iterations, stats.avg_exposed_comm_s * stats.iterations


def measure(shape: shapes.Shape, args: Any) -> sweep_report.ShapeResult:
    workload = shapes.workload(shape, args.iters, args.rounds)
    tensors, params, nbytes = gradient_size(workload)
    batches = suite.make_batches(workload)
    torch.manual_seed(0)  # same weights on every rank and for every contender
    base = workload.build()
    runs = [suite.make_contender(name, workload, base, batches, None) for name in CONTENDERS]
    ours = runs[CONTENDERS.index("gradsync")]
    caps = list(ours.model._config.caps)  # type: ignore[attr-defined]  # what the defaults chose on this link
    runs += [suite.make_contender(name, workload, base, batches, caps) for name in contenders.ALONE]
    flat, flat_cpu = cpu_recorded(suite.raw_allreduce(nbytes))
    runs += [flat, suite.forward_only(workload, base, batches)]
    runs.append(suite.to_first_gradient(workload, base, batches))
    before: list[tuple[int, float, float]] = []
    during = MachineLoad()
    during.start()
    samples = interleave(
        runs,
        args.rounds,
        args.iters,
        args.warmup,
        after_warmup=lambda: before.append(gradsync_timing(ours)),
        shuffle=True,  # 16 contenders: rotated, each would follow the same one in 15 rounds of 16
    )
    during.stop()
    n, comm, exposed = (a - b for a, b in zip(gradsync_timing(ours), before[0]))
    per_iter = torch.tensor([comm / n, exposed / n], dtype=torch.float64)
    dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
    buckets = len(ours.model.stats().buckets)  # type: ignore[attr-defined]
    nonfinite = nonfinite_contenders(runs)
    cpu = torch.tensor([statistics.median(flat_cpu)], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    runs.clear()  # both DDPs hold reference cycles: free them while the process group lives
    gc.collect()
    return sweep_report.ShapeResult(
        shape.name,
        shape.describe(),
        tensors,
        params,
        nbytes,
        args.iters,
        samples,
        buckets,
        per_iter[0].item(),
        per_iter[1].item(),
        during.other_cores(),
        nonfinite=nonfinite,
        flat_cpu_s=cpu.item(),
    )


def cpu_recorded(contender: Contender) -> tuple[Contender, list[float]]:
    """``contender`` with each call's process CPU time (every thread: gloo's too) appended to the list.

    [Note: the CPU floors]
    On a CPU machine where every core trains a rank, a collective's CPU time (gloo's socket copies and
    sums) has no spare core to hide on, however well it overlaps on the wire; the bound of issue #46
    counts none. Two measurements say what that costs: the flat all-reduce's own CPU time (this), which
    gives the CPU floor ``max(no_comm + that, to_first_gradient + flat all-reduce)`` (sweep_stats), and
    the ``ALONE`` contenders (lib/contenders.py), the engine and its PowerSGD hook over a group of one rank,
    which give what the engine's own copies, divisions and hooks (and the hook's arithmetic) cost.
    """
    cpu: list[float] = []
    inner = contender.step

    def step(i: int) -> None:
        start = time.process_time()
        inner(i)
        cpu.append(time.process_time() - start)

    return Contender(contender.name, step, contender.rest, contender.lead), cpu


def nonfinite_contenders(runs: list[Any]) -> list[str]:
    """The contenders whose weights hold a NaN or an infinity on some rank after the timed rounds.

    A step that computes garbage can be fast (NaN arithmetic costs nothing extra, denormals do), so a
    speed ratio against such a contender is no comparison; the report marks them.
    """
    trained = [r for r in runs if hasattr(r, "model")]
    flags = torch.tensor(
        [all(bool(torch.isfinite(p).all()) for p in r.model.parameters()) for r in trained], dtype=torch.int32
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [r.name for r, ok in zip(trained, flags.tolist()) if not ok]


def timeline(shape: shapes.Shape, args: Any) -> list[str]:
    """gradsync's defaults on ``shape`` under ``gradsync.trace``: the summary row and the median step's buckets."""
    workload = shapes.workload(shape)
    batches = suite.make_batches(workload)
    torch.manual_seed(0)
    base = workload.build()
    run = suite.make_contender("gradsync", workload, base, batches, None)
    parts = [
        suite.raw_allreduce(gradient_size(workload)[2]),
        suite.forward_only(workload, base, batches),
        suite.make_contender("no_comm", workload, base, batches, None),
    ]
    samples = interleave([run, *parts], rounds=3, iters=2, warmup=args.warmup)  # warms gradsync up, too
    flat, forward, bare, step = (statistics.median(samples[p.name]) * 1e3 for p in [*parts, run])
    with tempfile.TemporaryDirectory() as scratch, gradsync.trace(run.model, f"{scratch}/t.json") as recorded:  # type: ignore[attr-defined]
        for i in range(args.timeline_iters):
            run.step(i)
    its = sweep_timeline.iterations(recorded.events)
    by_total = sorted(its, key=lambda it: sum(it.phases_ms.values()))
    row = sweep_timeline.summary_row(shape.name, its, flat, forward, bare, step)
    return [row, *sweep_timeline.bucket_rows(shape.name, by_total[len(by_total) // 2])]


def write_timelines(rows: dict[str, list[str]], load: MachineLoad, args: Any) -> Path:
    lines = [f"# Sweep: where gradsync's step goes, per bucket ({today()})", ""]
    lines += [*environment_lines(launch.command_line()), f"- machine load: {load.describe()}"]
    lines += [
        f"- gradsync at its defaults, {args.timeline_iters} steps inside `gradsync.trace` after a warm-up; times on "
        "rank 0, medians over the steps, in ms; bucket times after backward's first gradient hook "
        "(lib/sweep_timeline.py says what each column is)",
        "",
        *sweep_timeline.SUMMARY_HEADER,
        *(r[0] for r in rows.values()),
        "",
        "The median step's buckets:",
        "",
        *sweep_timeline.BUCKET_HEADER,
        *(line for r in rows.values() for line in r[1:]),
        "",
    ]
    path = report_path("sweep-timeline")
    path.write_text("\n".join(lines))
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [s.name for s in shapes.GRID]
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument("--warmup", type=int, default=3, help="iterations per contender before timing (>= 3)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="iterations per contender per round")
    parser.add_argument("--timeline", nargs="+", choices=names, help="instead: where the time goes on these shapes")
    parser.add_argument("--timeline-iters", type=int, default=6, help="traced steps per --timeline shape")
    add_shape_study_options(parser, "sweep")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    if args.warmup < 3:
        raise SystemExit("--warmup must be at least 3: PowerSGD compresses from iteration 2 on")
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    load = MachineLoad()
    load.start()
    if args.timeline:
        rows = {name: timeline(next(s for s in shapes.GRID if s.name == name), args) for name in args.timeline}
        load.stop()
        if dist.get_rank() == 0:
            print(write_timelines(rows, load, args).read_text())
        dist.barrier()
        dist.destroy_process_group()
        return
    results = []
    for shape in (s for s in shapes.GRID if s.name in args.shapes):
        waited = wait_for_quiet(max_wait_s=args.wait_for_quiet) if args.wait_for_quiet > 0 else 0.0
        start = time.perf_counter()
        results.append(measure(shape, args))
        results[-1].waited_s = waited
        if dist.get_rank() == 0:
            print(f"{shape.name}: measured in {time.perf_counter() - start:.1f} s", flush=True)
    load.stop()
    if dist.get_rank() == 0:
        path = sweep_report.write(results, load, args, launch.command_line())
        print(path.read_text())
        print(f"report: {path}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
