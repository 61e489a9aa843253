"""Ratios over instances (benchmarks/lib/instance_stats.py) and the parity study's use of them, against hand values."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks is a package at the repository root, not installed

from benchmarks.lib import instance_stats  # noqa: E402
from benchmarks.lib.common import paired_ratio  # noqa: E402

pytestmark = pytest.mark.timeout(60)

ROUND_DRIFT = [1.00, 1.10, 0.95, 1.05, 1.02, 0.97]  # the machine's state, shared by every instance in a round
ROUND_NOISE = [1.004, 0.997, 1.002, 0.999, 1.003, 0.996]  # small per-block noise, rotated per instance


def timed(effects: dict[str, float], iters: int = 2) -> dict[str, list[float]]:
    """Samples of instances whose steps take ``effect`` x the round's drift x a little noise, every round."""
    samples: dict[str, list[float]] = {}
    for k, (name, effect) in enumerate(effects.items()):
        samples[name] = []
        for r, drift in enumerate(ROUND_DRIFT):
            noise = ROUND_NOISE[(r + k) % len(ROUND_NOISE)]
            samples[name] += [0.05 * effect * drift * noise] * iters
    return samples


def test_t_quantiles_match_students_t() -> None:
    assert instance_stats.t_quantile(4, 0.90) == 2.132
    assert instance_stats.t_quantile(4.9, 0.95) == 2.776  # between rows: the lower df's, wider quantile
    assert instance_stats.t_quantile(1000, 0.95) == 1.980
    with pytest.raises(ValueError, match="degree of freedom"):
        instance_stats.t_quantile(0.5, 0.90)
    stats = pytest.importorskip("scipy.stats", reason="scipy gives an independent check of the table")
    for confidence, table in instance_stats._T_QUANTILES.items():
        for df, value in table.items():
            assert value == pytest.approx(stats.t.ppf(0.5 + confidence / 2, df), abs=0.0015)


def test_levels_take_out_each_rounds_drift() -> None:
    samples = {"a": [2.0, 4.0], "b": [8.0, 16.0]}  # round 1 twice as slow for both
    levels = instance_stats.instance_levels(samples, ["a", "b"], iters=1)
    # Round 0: log 2 - (log 2 + log 8) / 2 = -log 2; round 1 the same, the drift gone.
    assert levels["a"] == pytest.approx([-math.log(2), -math.log(2)])
    assert levels["b"] == pytest.approx([math.log(2), math.log(2)])


def test_a_real_gap_is_found_with_instance_effects_around_it() -> None:
    ours = {f"ours#{k}": 1.10 * e for k, e in enumerate([1.00, 1.04, 0.98, 1.02])}
    theirs = {f"theirs#{k}": e for k, e in enumerate([1.00, 0.97, 1.03, 1.01])}
    samples = timed({**ours, **theirs})
    result = instance_stats.compare(samples, list(ours), list(theirs), iters=2)
    expected = statistics.geometric_mean(ours.values()) / statistics.geometric_mean(theirs.values())
    assert result.ratio == pytest.approx(expected, rel=2e-3)  # the noise averages out to within 0.2%
    assert result.low > 1.0  # 10% slower: flagged


def test_identical_code_with_instance_effects_is_not_flagged() -> None:
    ours = {f"ours#{k}": e for k, e in enumerate([1.05, 0.95, 1.02, 0.99])}
    theirs = {f"theirs#{k}": e for k, e in enumerate([1.00, 1.04, 0.97, 1.00])}
    samples = timed({**ours, **theirs})
    result = instance_stats.compare(samples, list(ours), list(theirs), iters=2)
    assert result.low < 1.0 < result.high
    # Negative control: one instance against one other, rounds alone, calls the same code 5% slower.
    one_pair = paired_ratio(samples["ours#0"], samples["theirs#0"], iters=2)
    assert one_pair[1] > 1.0
    # And the spread between instances is several times what rounds alone show.
    assert result.instance_sd > 5 * result.rounds_se


def test_interval_is_welchs() -> None:
    ours = {f"o{k}": e for k, e in enumerate([1.10, 1.00, 1.06])}
    theirs = {f"t{k}": e for k, e in enumerate([1.00, 0.99, 1.01, 1.00])}
    samples = {n: [v] * 2 for n, v in {**ours, **theirs}.items()}  # one round: levels are the logs, centred
    result = instance_stats.compare(samples, list(ours), list(theirs), iters=2, confidence=0.95)
    a, b = [math.log(v) for v in ours.values()], [math.log(v) for v in theirs.values()]
    va, vb = statistics.variance(a) / 3, statistics.variance(b) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert 2 < df < 3  # by hand: mostly ours' spread, two degrees of freedom: t = 4.303
    half = 4.303 * math.sqrt(va + vb)
    diff = statistics.fmean(a) - statistics.fmean(b)
    assert result.interval == pytest.approx((math.exp(diff), math.exp(diff - half), math.exp(diff + half)))
    stats = pytest.importorskip("scipy.stats", reason="scipy gives an independent check of Welch's interval")
    reference = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    # The table's df is floored, so the interval may only be wider than the exact one, and not by much.
    assert math.log(result.low) <= reference.low + 1e-12 and math.log(result.high) >= reference.high - 1e-12
    assert (math.log(result.high) - math.log(result.low)) / (reference.high - reference.low) < 1.15


def test_an_instance_interval_needs_two_instances_a_side() -> None:
    samples = timed({"a": 1.0, "b": 1.0, "c": 1.0})
    with pytest.raises(ValueError, match="two or more instances"):
        instance_stats.compare(samples, ["a"], ["b", "c"], iters=2)


def test_pooled_over_shapes_is_a_t_interval_over_shapes() -> None:
    ratio, low, high = instance_stats.pooled_over_shapes([1.1, 0.9, 1.0])
    logs = [math.log(1.1), math.log(0.9), 0.0]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)  # t with 2 df, 95%
    mean = statistics.fmean(logs)
    assert (ratio, low, high) == pytest.approx((math.exp(mean), math.exp(mean - half), math.exp(mean + half)))


def test_parity_study_compares_the_right_instances() -> None:
    from benchmarks.studies import parity

    names = {
        **{f"gradsync#{k}": e for k, e in enumerate([1.02, 1.03, 1.01, 1.02])},
        # torch's first half 10% slower than its second: its A/A control must say so, and only it.
        **{f"torch_ddp#{k}": e for k, e in enumerate([1.10, 1.11, 1.00, 1.01])},
    }
    row = parity.compare_shape("shape", timed(names), count=4, iters=2)
    assert row.torch_aa.ratio == pytest.approx(math.sqrt(1.10 * 1.11) / math.sqrt(1.00 * 1.01), rel=2e-3)
    assert row.torch_aa.low > 1.0
    assert row.ours_aa.ratio == pytest.approx(math.sqrt(1.02 * 1.03) / math.sqrt(1.01 * 1.02), rel=2e-3)
    torch_mean = statistics.geometric_mean([1.10, 1.11, 1.00, 1.01])
    assert row.per_instance["gradsync#0"] == pytest.approx(1.02 / torch_mean, rel=2e-3)
    assert parity._flagged([row], lambda r: r.torch_aa) == ["shape"]
    assert parity._flagged([row], lambda r: r.ours_aa) == []
