"""Parity: gradsync's defaults against torch's DDP on the sweep's shapes, several instances of each.

Run from the repository root (about 10 minutes on plain loopback, 2 cores):

    python -m benchmarks parity                  # plain loopback
    python -m benchmarks parity --link 1gbit     # a shaped link (root; lib/link.py)
    python -m benchmarks parity --pair powersgd_r1 --link 1gbit   # the PowerSGD hooks at rank 1 instead

Issue #46 asks that gradsync's defaults be no slower than torch's DDP on any shape. The sweep answers
with one instance of each, and a per-round interval; but two instances of the *same* code differ by
a few percent for the whole of a run ([Note: instance effects] in lib/instance_stats.py), so that
interval flags identical code and its pooled ratio carries whatever one pair of instances drew. Here
each of the two is built ``--instances`` times per shape (default 4) from the same weights, all of
them interleaved in shuffled rounds, and an instance is the unit of the interval. The report gives,
per shape, gradsync / torch DDP with a 90% Welch interval over instances; two A/A controls with the
same arithmetic (torch's first half of instances against its second half, and gradsync's); the
spread between instances against what rounds alone would give; and the ratio pooled over shapes with
a 95% t interval over shapes. ``--pair powersgd_r1`` (or ``powersgd_r4``) compares gradsync's PowerSGD hook
with torch's ``powerSGD_hook`` the same way (issue #46: faster on every shape where either compresses);
a shape where an instance's weights went non-finite is left out and named. Rank 0 writes
``benchmarks/results/YYYY-MM-DD-parity[-PAIR][-LABEL][-RATE].md``.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import common, instance_stats, launch, link, shapes
from benchmarks.lib.common import MachineLoad
from benchmarks.studies import suite, sweep

# --pair: (gradsync's contender, torch's), lib/contenders.py's names; what the report calls them.
PAIRS = {
    "exact": ("gradsync", "torch_ddp", "gradsync's defaults", "torch's DDP"),
    "powersgd_r1": (
        "gradsync_powersgd_r1",
        "torch_powersgd_r1",
        "gradsync's PowerSGD r=1",
        "torch's powerSGD_hook r=1",
    ),
    "powersgd_r4": (
        "gradsync_powersgd_r4",
        "torch_powersgd_r4",
        "gradsync's PowerSGD r=4",
        "torch's powerSGD_hook r=4",
    ),
}
CONFIDENCE = 0.90  # per shape; pooled over shapes: 95%


def instance_names(name: str, count: int) -> list[str]:
    return [f"{name}#{k}" for k in range(count)]


@dataclass(frozen=True)
class ShapeParity:
    name: str
    torch_ms: float  # median step of torch's contender over all its instances
    vs_torch: instance_stats.Comparison
    torch_aa: instance_stats.Comparison  # torch's first half of instances / its second half
    ours_aa: instance_stats.Comparison  # gradsync's, likewise
    per_instance: dict[str, float]  # each instance's step over the geometric mean of torch's instances
    nonfinite: list[str] = field(default_factory=list)  # instances whose weights went NaN or infinite


def compare_shape(
    name: str, samples: dict[str, list[float]], count: int, iters: int, pair: str = "exact"
) -> ShapeParity:
    """The comparisons of one shape's samples (``count`` instances of each contender, named by ``instance_names``)."""
    ours, theirs = (instance_names(n, count) for n in PAIRS[pair][:2])
    half = count // 2
    levels = instance_stats.instance_levels(samples, ours + theirs, iters)
    mean_level = {n: statistics.fmean(v) for n, v in levels.items()}
    torch_centre = statistics.fmean(mean_level[n] for n in theirs)
    return ShapeParity(
        name,
        statistics.median(t for n in theirs for t in samples[n]) * 1e3,
        instance_stats.compare(samples, ours, theirs, iters, CONFIDENCE),
        instance_stats.compare(samples, theirs[:half], theirs[half:], iters, CONFIDENCE),
        instance_stats.compare(samples, ours[:half], ours[half:], iters, CONFIDENCE),
        {n: math.exp(mean_level[n] - torch_centre) for n in ours + theirs},
    )


def measure(shape: shapes.Shape, args: Any) -> ShapeParity:
    workload = shapes.workload(shape, args.iters, args.rounds)
    batches = suite.make_batches(workload)
    torch.manual_seed(0)  # same weights on every rank and for every instance
    base = workload.build()
    runs = []
    pair = PAIRS[args.pair][:2]
    for k in range(args.instances):
        # Which of a pair is built first alternates: where an instance's tensors land, which decides part of its
        # speed for the whole run ([Note: instance effects]), then favours neither contender.
        for name in pair if k % 2 == 0 else reversed(pair):
            run = suite.make_contender(name, workload, base, batches, None)
            run.name = instance_names(name, args.instances)[k]
            runs.append(run)
    samples = common.interleave(runs, args.rounds, args.iters, args.warmup, shuffle=True)
    nonfinite = sweep.nonfinite_contenders(runs)
    runs.clear()  # both DDPs hold reference cycles: free them while the process group lives
    gc.collect()
    return replace(compare_shape(shape.name, samples, args.instances, args.iters, args.pair), nonfinite=nonfinite)


def _fmt(c: instance_stats.Comparison) -> str:
    return f"{c.ratio:.3f} [{c.low:.3f}, {c.high:.3f}]"


def _flagged(rows: list[ShapeParity], pick: Any) -> list[str]:
    """Shapes whose whole 90% interval lies above 1: slower, by the instance interval."""
    return [r.name for r in rows if pick(r).low > 1.0]


def _faster(rows: list[ShapeParity]) -> str:
    """How many shapes ours is faster on, by the point estimate and by the whole interval, and which not."""
    faster = [r for r in rows if r.vs_torch.ratio < 1.0]
    below = [r for r in rows if r.vs_torch.high < 1.0]
    others = [r.name for r in rows if r.vs_torch.ratio >= 1.0]
    return (
        f"{len(faster)} of {len(rows)} ({len(below)} with the whole interval below 1)"
        f"{'; not on ' + ', '.join(others) if others else ''}"
    )


def report(all_rows: list[ShapeParity], load: MachineLoad, args: Any, command: str) -> list[str]:
    _, _, ours_label, theirs_label = PAIRS[args.pair]
    rows = [r for r in all_rows if not r.nonfinite]
    left_out = [f"{r.name} ({', '.join(r.nonfinite)})" for r in all_rows if r.nonfinite]
    if not rows:
        return [
            f"# Parity: {ours_label} against {theirs_label} ({common.today()})",
            "",
            f"Every shape left out: {left_out}",
            "",
        ]
    pooled = instance_stats.pooled_over_shapes([r.vs_torch.ratio for r in rows])
    pooled_torch_aa = instance_stats.pooled_over_shapes([r.torch_aa.ratio for r in rows])
    pooled_ours_aa = instance_stats.pooled_over_shapes([r.ours_aa.ratio for r in rows])
    spread = [r.vs_torch.instance_sd / r.vs_torch.rounds_se for r in rows if r.vs_torch.rounds_se > 0]
    half = args.instances // 2
    lines = [f"# Parity: {ours_label} against {theirs_label}, {args.instances} instances each ({common.today()})", ""]
    lines += [*common.environment_lines(command), f"- machine load: {load.describe()}"]
    lines += [
        f"- per shape: {args.instances} instances of {ours_label} and of {theirs_label} from the same weights (built "
        f"in pairs, which of a pair first alternating), {args.warmup} warm-up iterations, then {args.rounds} rounds "
        f"of {args.iters} iterations, every instance in every round, in an order drawn anew each round; a step is "
        "the slowest rank's",
        "- an instance's level: mean over rounds of log(block median) less the round's geometric mean over all "
        "instances; a ratio: exp of the difference of mean levels, 90% Welch t interval over instances "
        "([Note: instance effects] in lib/instance_stats.py); pooled: geometric mean over shapes, 95% t "
        "interval over shapes",
        f"- A/A controls: {theirs_label}'s instances 0-{half - 1} against {half}-{args.instances - 1}, and "
        f"{ours_label}'s likewise; identical code, the same arithmetic",
        *(
            [f"- left out, an instance's weights non-finite after the rounds: {'; '.join(left_out)}"]
            if left_out
            else []
        ),
        "",
        "| | result |",
        "|---|---|",
        f"| gradsync / torch, pooled over {len(rows)} shapes (95%) | {pooled[0]:.3f} [{pooled[1]:.3f}, "
        f"{pooled[2]:.3f}] |",
        f"| A/A torch, pooled (95%) | {pooled_torch_aa[0]:.3f} [{pooled_torch_aa[1]:.3f}, {pooled_torch_aa[2]:.3f}] |",
        f"| A/A gradsync, pooled (95%) | {pooled_ours_aa[0]:.3f} [{pooled_ours_aa[1]:.3f}, {pooled_ours_aa[2]:.3f}] |",
        f"| gradsync faster than torch (ratio below 1) | {_faster(rows)} |",
    ]
    for label, pick in (
        ("gradsync slower than torch (whole 90% interval above 1)", lambda r: r.vs_torch),
        ("A/A torch: first half slower than second", lambda r: r.torch_aa),
        ("A/A gradsync: first half slower than second", lambda r: r.ours_aa),
    ):
        flagged = _flagged(rows, pick)
        lines.append(f"| {label} | {len(flagged)} of {len(rows)}{': ' + ', '.join(flagged) if flagged else ''} |")
    chance = (1 - CONFIDENCE) / 2  # a 90% interval lies wholly above 1 for 5% of identical pairs
    lines.append(
        f"| the same test on identical code, by chance | {chance * len(rows):.2f} of {len(rows)} on average; at least "
        f"one with probability {1 - (1 - chance) ** len(rows):.2f} |"
    )
    if spread:
        lines.append(
            "| spread between instances / what rounds alone give, median over shapes | "
            f"{statistics.median(spread):.2f} (1: no instance effect) |"
        )
    lines += [
        "",
        "| shape | torch ms | gradsync / torch (90%) | A/A torch | A/A gradsync | instance sd % | "
        "rounds-only se % | instances (step / torch's mean) |",
        "|---|---:|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        instances = " ".join(
            f"{'g' if n.startswith('gradsync') else 't'}{n.rsplit('#', 1)[1]} {v:.3f}"
            for n, v in r.per_instance.items()
        )
        lines.append(
            f"| {r.name} | {r.torch_ms:.1f} | {_fmt(r.vs_torch)} | {_fmt(r.torch_aa)} | {_fmt(r.ours_aa)} | "
            f"{100 * r.vs_torch.instance_sd:.1f} | {100 * r.vs_torch.rounds_se:.1f} | {instances} |"
        )
    return [*lines, ""]


def write_report(rows: list[ShapeParity], load: MachineLoad, args: Any) -> Path:
    """``results/YYYY-MM-DD-parity[-PAIR][-LABEL][-RATE].md``; the exact pair and no label add nothing to the name."""
    kind = "-".join(["parity", *([args.pair] if args.pair != "exact" else []), *([args.label] if args.label else [])])
    path = common.report_path(kind)
    path.write_text("\n".join(report(rows, load, args, launch.command_line())))
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [s.name for s in shapes.GRID]
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument(
        "--pair", choices=sorted(PAIRS), default="exact", help="what is compared (default: the exact reducers)"
    )
    parser.add_argument("--instances", type=int, default=4, help="instances of each contender per shape (even, >= 4)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations per instance before timing (>= 3)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=2, help="iterations per instance per round")
    common.add_shape_study_options(parser, "parity")
    args = parser.parse_args()
    if args.warmup < 3:
        parser.error("--warmup must be at least 3: PowerSGD compresses from iteration 2 on")
    if args.instances < 4 or args.instances % 2:
        parser.error("--instances must be even and at least 4: each A/A control compares two halves of two or more")
    return args


def main() -> None:
    args = parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    load = MachineLoad()
    load.start()
    rows = []
    for shape in (s for s in shapes.GRID if s.name in args.shapes):
        if args.wait_for_quiet > 0:
            common.wait_for_quiet(max_wait_s=args.wait_for_quiet)
        start = time.perf_counter()
        rows.append(measure(shape, args))
        if dist.get_rank() == 0:
            print(f"{shape.name}: {_fmt(rows[-1].vs_torch)} in {time.perf_counter() - start:.1f} s", flush=True)
    load.stop()
    if dist.get_rank() == 0:
        path = write_report(rows, load, args)
        print(f"{path.read_text()}\nreport: {path}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
