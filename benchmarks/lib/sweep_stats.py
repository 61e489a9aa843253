"""The sweep's arithmetic: the per-round bound, the distribution over shapes, and issue #46's targets.

Pure functions of the timed samples (no process group), so tests can check them by hand.

[Note: the bound, per round]
An exact reducer's step takes at least ``max(no_comm, forward + one flat all-reduce)``
(suite.py's ``bound_lines``). The sweep takes it per round, from the medians of the three
contenders' blocks in that round, so a contender's ratio to it is a paired ratio like any other
(lib/common.py's ``paired_ratio``): drift between rounds cancels, and the 90% interval is a
bootstrap over rounds. ``bound_series`` repeats each round's bound ``iters`` times, so it can stand
in wherever a contender's samples go.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass, replace

from benchmarks.lib.common import geometric_mean_interval, paired_ratio, round_ratios

NO_COMM, FORWARD, RAW, FIRST_GRADIENT = "no_comm", "forward_only", "raw_allreduce", "to_first_gradient"
Samples = dict[str, list[float]]
Interval = tuple[float, float, float]  # (median over rounds, low, high) of per-round ratios

# Issue #46's targets: gradsync's defaults over the bound, and its best compressing hook over no_comm.
EXACT_TARGETS = {"median": 1.05, "p90": 1.08, "worst": 1.12}
HOOK_MEDIAN_TARGET = 1.15


def bound_series(samples: Samples, iters: int, start: str = FORWARD, comm_cpu_s: float = 0.0) -> list[float]:
    """Each round's ``max(no_comm, forward + flat all-reduce)``, ``iters`` times ([Note: the bound, per round]).

    ``start=FIRST_GRADIENT``: the tight bound, which counts that no byte exists before backward has
    produced the first gradient (suite.py's ``tight_bound_ms``). ``comm_cpu_s``: the CPU floor, which
    also counts that the flat all-reduce's CPU time (gloo's copies and sums) has no spare core to run
    on when every core trains a rank: ``max(no_comm + comm_cpu_s, start + flat all-reduce)``.
    """
    rounds = len(samples[NO_COMM]) // iters
    series: list[float] = []
    for r in range(rounds):
        part = slice(r * iters, (r + 1) * iters)
        floor = statistics.median(samples[NO_COMM][part]) + comm_cpu_s
        overlap_limit = statistics.median(samples[start][part]) + statistics.median(samples[RAW][part])
        series += [max(floor, overlap_limit)] * iters
    return series


def to_bound(samples: Samples, name: str, iters: int, start: str = FORWARD, comm_cpu_s: float = 0.0) -> Interval:
    return paired_ratio(samples[name], bound_series(samples, iters, start, comm_cpu_s), iters)


def to_reference(samples: Samples, name: str, reference: str, iters: int) -> Interval:
    return paired_ratio(samples[name], samples[reference], iters)


@dataclass(frozen=True)
class Distribution:
    median: float
    p90: float
    worst: float
    worst_shape: str


def distribution(per_shape: dict[str, float]) -> Distribution:
    """Median, 90th percentile (linear interpolation between order statistics) and maximum over shapes."""
    values = sorted(per_shape.values())
    p90 = statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]
    worst = max(per_shape, key=lambda shape: per_shape[shape])
    return Distribution(statistics.median(values), p90, per_shape[worst], worst)


@dataclass(frozen=True)
class Target:
    what: str
    passed: bool
    measured: str


def exact_targets(ratios: dict[str, float]) -> list[Target]:
    """gradsync's defaults over the bound: median, p90 and worst against EXACT_TARGETS."""
    d = distribution(ratios)
    found = {"median": d.median, "p90": d.p90, "worst": d.worst}
    return [
        Target(f"gradsync defaults / bound, {key} <= {limit:.2f}", found[key] <= limit, f"{found[key]:.3f}")
        for key, limit in EXACT_TARGETS.items()
    ]


def not_slower(vs_torch: dict[str, Interval], who: str = "gradsync defaults", than: str = "torch DDP") -> Target:
    """No shape where the interval of ``who`` / ``than`` lies wholly above 1."""
    slower = sorted(shape for shape, (_, low, _) in vs_torch.items() if low > 1.0)
    text = "on every shape" if not slower else f"slower on {len(slower)}: " + ", ".join(slower)
    return Target(f"{who} no slower than {than} on any shape (90% interval)", not slower, text)


def best_hook(hook_ratios: dict[str, dict[str, float]]) -> tuple[str, Distribution]:
    """The gradsync hook with the lowest median (over shapes) of its ratio to no_comm."""
    dists = {hook: distribution(per_shape) for hook, per_shape in hook_ratios.items()}
    best = min(dists, key=lambda hook: dists[hook].median)
    return best, dists[best]


def hook_target(hook_ratios: dict[str, dict[str, float]], cpu_floor: float | None = None) -> Target:
    """``cpu_floor``: the median over shapes of PowerSGD r=1 alone / no_comm (the hook's CPU, no wait), if measured."""
    hook, d = best_hook(hook_ratios)
    limit = HOOK_MEDIAN_TARGET
    measured = f"{hook}: {d.median:.3f}"
    if cpu_floor is not None:
        measured += f" (its CPU alone, no link: {cpu_floor:.3f})"
    return Target(f"gradsync's best hook / no_comm, median <= {limit:.2f}", d.median <= limit, measured)


def faster_than_torch(
    rank: int,
    vs_torch: dict[str, Interval],
    torch_nonfinite: Collection[str] = (),
    ours_nonfinite: Collection[str] = (),
    who: str = "gradsync powersgd",
) -> Target:
    """``who`` (gradsync's PowerSGD) faster than torch's at the same rank on every shape (per-round median ratio < 1).

    A shape where torch's weights went non-finite is no comparison (NaN arithmetic is cheap) and is left
    out, by name; one where gradsync's did fails, whatever its speed.
    """
    compared = {shape: v for shape, v in vs_torch.items() if shape not in torch_nonfinite}
    slower = sorted(shape for shape, (ratio, _, _) in compared.items() if ratio >= 1.0 or shape in ours_nonfinite)
    clear = sum(1 for _, _, high in compared.values() if high < 1.0)
    text = f"faster on {len(compared) - len(slower)} of {len(compared)} ({clear} with the whole interval below 1)"
    if slower:
        text += "; not on " + ", ".join(slower)
    if torch_nonfinite:
        text += "; left out, torch's weights non-finite: " + ", ".join(sorted(torch_nonfinite))
    return Target(f"{who} r={rank} faster than torch's powerSGD_hook r={rank} on every shape", not slower, text)


# [Note: the A/A control]
# The per-shape targets ("no slower than torch's DDP on any shape", "faster than torch's powerSGD_hook on
# every shape") ask 24-27 short comparisons to all come out one way. How often does that fail for
# *identical* code? The sweep answers on the same run: a second instance of torch's DDP and of its
# powerSGD_hook r=1 (``CONTROLS``), built from the same weights, interleaved like every contender, and
# put through the very test gradsync is put through against the first instance. Code compared with
# itself is "faster" on about half the shapes, and any shape it is "slower" on is the test's own false
# alarm (90% intervals over five rounds, several instances' memory placements): a gradsync result is
# only news where it differs from what the control shows.
CONTROLS = {"torch_ddp": "torch_ddp_again", "torch_powersgd_r1": "torch_powersgd_r1_again"}


def even_odds_ratio(control: dict[str, Interval]) -> tuple[float, float]:
    """``(spread, ratio)``: the A/A's per-shape spread and the ratio a contender would need on *every* shape
    for all of them to come out below 1 with even odds.

    ``spread`` is the standard deviation over shapes of the A/A's log ratio (its true ratio is 1, so that is
    the per-shape measurement's noise). With noise like it, independent and normal in the log, all ``n``
    shapes land below 1 with probability 1/2 when each one's true ratio is ``exp(-z * spread)``,
    ``z = Phi^-1(0.5 ** (1 / n))`` ([Note: the A/A control]).
    """
    logs = [math.log(ratio) for ratio, _, _ in control.values()]
    spread = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    z = statistics.NormalDist().inv_cdf(0.5 ** (1 / len(logs)))
    return spread, math.exp(-z * spread)


def pooled_ratio(per_shape: list[tuple[list[float], list[float], int]]) -> Interval:
    """One ratio over every shape: the geometric mean of all rounds' ratios, with a 95% normal interval.

    ``per_shape``: each shape's ``(samples, reference samples, iters)``. A round's ratio is its median step
    over the reference's median step in the same round, as in ``paired_ratio``; pooling the rounds of every
    shape answers "slower or not, over the sweep" to a resolution no single shape's five rounds give
    ([Note: the A/A control]).
    """
    return geometric_mean_interval([ratio for args in per_shape for ratio in round_ratios(*args)], 1.96)


def control_targets(
    exact_vs_self: dict[str, Interval], hook_vs_self: dict[str, Interval], torch_nonfinite: Collection[str] = ()
) -> list[Target]:
    """The two per-shape tests applied to torch against a second instance of itself ([Note: the A/A control])."""
    slower = not_slower(exact_vs_self, who="torch DDP (a second instance)", than="torch DDP")
    faster = faster_than_torch(1, hook_vs_self, torch_nonfinite, who="torch's powerSGD_hook (a second instance)")
    compared = {shape: v for shape, v in hook_vs_self.items() if shape not in torch_nonfinite}
    spread, needed = even_odds_ratio(compared)
    odds = (
        f"; spread over shapes (sd of log ratio) {spread:.3f}: faster on all {len(compared)} with even odds takes "
        f"{needed:.3f} or less on each"
    )
    return [slower, replace(faster, measured=faster.measured + odds)]
