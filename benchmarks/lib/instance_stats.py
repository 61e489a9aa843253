"""Ratios between two contenders that count instance effects: several instances of each, the instance the unit.

[Note: instance effects]
Two instances of the same code, built from the same weights in the same process and interleaved
round by round, do not run equally fast. Scratch runs on loopback, 2026-12-07: 30 rounds of 4 steps
put one instance of gradsync at 1.010 [0.981, 1.040] of torch's DDP on a decoder and a second one,
the same run, at 1.054 [1.021, 1.088]; with three instances of each on `gpt_b1_v8k_d256_L2_tied`,
building each torch instance just before its gradsync one put gradsync at 1.047 and 1.038 (two runs),
building gradsync first at 0.991 (one run). What makes an instance fast or
slow (where its tensors landed, what the allocator hands it each step; which of two is built first
moves it) stays with it for the whole run, so rounds do not average it out: an interval from rounds
alone (``paired_ratio``) measures one instance against one other, and with many rounds it is much
narrower than the difference between two instances of the same code.

So here each contender is built ``k`` times (in pairs, which of a pair first alternating), every
instance interleaved with every other, and an instance is the unit: its *level* is the mean over
rounds of log(its block median) less the log of the round's geometric mean over every instance
(which takes out drift between rounds). The ratio of two contenders is exp(mean level of ours -
mean level of theirs), with a Welch t interval over the instances' levels: the spread between
instances, rounds' noise included, is what the interval is made of. Pooled over shapes, each
shape's log ratio is one observation (each shape has instances of its own) and the interval is a t
interval over shapes.

Pure functions of the timed samples, so tests can check them by hand.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from benchmarks.lib.common import geometric_mean_interval, per_block

Samples = dict[str, list[float]]

# Student's t quantiles for two-sided 90% (0.95) and 95% (0.975) intervals, by degrees of freedom.
# A df between two rows takes the lower row's (larger) quantile: the interval errs wide.
_T_QUANTILES: dict[float, dict[int, float]] = {
    0.90: {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833,
           10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 25: 1.708, 30: 1.697, 60: 1.671, 120: 1.658},
    0.95: {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
           10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 60: 2.000, 120: 1.980},
}  # fmt: skip


def t_quantile(df: float, confidence: float) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` degrees of freedom (table above)."""
    table = _T_QUANTILES[confidence]
    rows = [d for d in table if d <= df]
    if not rows:
        raise ValueError(f"t interval needs at least 1 degree of freedom, got {df}")
    return table[max(rows)]


def instance_levels(samples: Samples, names: list[str], iters: int) -> dict[str, list[float]]:
    """Per instance, each round's log(block median) less the log of that round's geometric mean over ``names``."""
    rounds = min(len(samples[n]) for n in names) // iters
    if rounds < 1:
        raise ValueError(f"no complete round of {iters} iterations in the samples of {names}")
    logs = {n: [math.log(m) for m in per_block(samples[n], iters, rounds)] for n in names}
    centre = [statistics.fmean(logs[n][r] for n in names) for r in range(rounds)]
    return {n: [value - c for value, c in zip(logs[n], centre)] for n in names}


@dataclass(frozen=True)
class Comparison:
    """ours / theirs over instances: the ratio and its interval, and what the instances' spread is made of."""

    ratio: float
    low: float
    high: float
    instance_sd: float  # sd of instance levels (log), pooled over both contenders
    rounds_se: float  # the sd an instance's level would have if rounds alone varied (log), averaged

    @property
    def interval(self) -> tuple[float, float, float]:
        return self.ratio, self.low, self.high


def compare(samples: Samples, ours: list[str], theirs: list[str], iters: int, confidence: float = 0.90) -> Comparison:
    """``ours`` / ``theirs`` ([Note: instance effects]): each a list of at least two instances' names."""
    if len(ours) < 2 or len(theirs) < 2:
        raise ValueError(f"an instance interval needs two or more instances a side, got {ours} and {theirs}")
    per_round = instance_levels(samples, ours + theirs, iters)
    level = {n: statistics.fmean(v) for n, v in per_round.items()}
    a, b = [level[n] for n in ours], [level[n] for n in theirs]
    var_a, var_b = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    se = math.sqrt(var_a + var_b)
    half = t_quantile(welch_df(var_a, len(a), var_b, len(b)), confidence) * se
    within = [x - statistics.fmean(a) for x in a] + [x - statistics.fmean(b) for x in b]
    instance_sd = math.sqrt(sum(x * x for x in within) / (len(within) - 2))
    rounds = len(next(iter(per_round.values())))
    rounds_se = statistics.fmean(
        statistics.stdev(v) / math.sqrt(rounds) if rounds > 1 else 0.0 for v in per_round.values()
    )
    return Comparison(math.exp(diff), math.exp(diff - half), math.exp(diff + half), instance_sd, rounds_se)


def welch_df(var_a: float, n_a: int, var_b: float, n_b: int) -> float:
    """Welch-Satterthwaite degrees of freedom of a difference of means (``var_*``: the means' variances)."""
    denominator = var_a**2 / (n_a - 1) + var_b**2 / (n_b - 1)
    if denominator == 0.0:
        return float(n_a + n_b - 2)
    return (var_a + var_b) ** 2 / denominator


def pooled_over_shapes(ratios: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The geometric mean of per-shape ratios with a t interval over shapes (each shape one observation)."""
    if not ratios:
        raise ValueError("a pooled ratio needs at least one shape's ratio")
    return geometric_mean_interval(ratios, t_quantile(len(ratios) - 1, confidence) if len(ratios) > 1 else 0.0)
