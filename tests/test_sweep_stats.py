"""The sweep's arithmetic and shapes (benchmarks/lib/sweep_stats.py, shapes.py), single process, against hand values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks is a package at the repository root, not installed

from benchmarks.lib import shapes, sweep_stats  # noqa: E402
from benchmarks.lib.sweep_stats import FORWARD, NO_COMM, RAW  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def two_rounds() -> dict[str, list[float]]:
    # Round 0: forward + flat all-reduce (0.5 + 2.5 = 3) exceeds no_comm (median of 1 and 3 = 2).
    # Round 1: no_comm (median 4) exceeds forward + flat all-reduce (1 + 2 = 3).
    return {NO_COMM: [1.0, 3.0, 4.0, 4.0], FORWARD: [0.5, 0.5, 1.0, 1.0], RAW: [2.5, 2.5, 2.0, 2.0]}


def test_bound_per_round_is_the_larger_of_the_two_limits() -> None:
    assert sweep_stats.bound_series(two_rounds(), iters=2) == [3.0, 3.0, 4.0, 4.0]


def test_cpu_floor_adds_the_collectives_cpu_to_no_comm() -> None:
    samples = two_rounds()
    # Round 0: max(2 + 1.5, 0.5 + 2.5) = 3.5; round 1: max(4 + 1.5, 1 + 2) = 5.5.
    assert sweep_stats.bound_series(samples, iters=2, comm_cpu_s=1.5) == [3.5, 3.5, 5.5, 5.5]
    # Negative control: without the CPU the same samples give the plain bound.
    assert sweep_stats.bound_series(samples, iters=2, comm_cpu_s=0.0) == [3.0, 3.0, 4.0, 4.0]


def test_ratio_to_bound_is_per_round() -> None:
    samples = two_rounds()
    samples["c"] = [3.3, 3.3, 4.4, 4.4]  # 1.1x each round's bound
    ratio, low, high = sweep_stats.to_bound(samples, "c", iters=2)
    assert ratio == pytest.approx(1.1) and low == pytest.approx(1.1) and high == pytest.approx(1.1)
    # Negative control: against no_comm alone the same contender is 1.65x in round 0, not 1.1x.
    samples["d"] = samples[NO_COMM]
    assert sweep_stats.to_bound(samples, "d", iters=2)[0] < 1.0


def test_distribution_by_hand() -> None:
    per_shape = {f"s{k}": float(k) for k in range(1, 11)}
    d = sweep_stats.distribution(per_shape)
    # Inclusive quantile: position 0.9 * (10 - 1) = 8.1 between 9 and 10 (0-based 8 and 9).
    assert (d.median, d.p90, d.worst, d.worst_shape) == (pytest.approx(5.5), pytest.approx(9.1), 10.0, "s10")


def test_targets_pass_and_fail() -> None:
    inside = {f"s{k}": 1.0 + k / 1000 for k in range(20)}  # all <= 1.019
    assert all(t.passed for t in sweep_stats.exact_targets(inside))
    outside = dict(inside, worst=1.13)
    passed = [t.passed for t in sweep_stats.exact_targets(outside)]
    assert passed == [True, True, False]  # median and p90 hold, the worst fails
    assert sweep_stats.not_slower({"a": (1.02, 0.99, 1.05)}).passed
    assert not sweep_stats.not_slower({"a": (1.02, 1.01, 1.05), "b": (0.9, 0.8, 1.0)}).passed
    assert sweep_stats.faster_than_torch(1, {"a": (0.9, 0.8, 1.01)}).passed
    assert not sweep_stats.faster_than_torch(1, {"a": (0.9, 0.8, 1.0), "b": (1.0, 0.9, 1.1)}).passed
    hooks = {"h1": {"a": 1.2, "b": 1.3}, "h2": {"a": 1.1, "b": 1.14}}
    target = sweep_stats.hook_target(hooks)
    assert target.passed and target.measured.startswith("h2")


def test_a_shape_where_torch_went_nonfinite_is_no_comparison() -> None:
    vs_torch = {"a": (0.9, 0.8, 1.0), "nan": (1.9, 1.8, 2.0)}
    # Negative control: counted, torch's NaN shape fails the target.
    assert not sweep_stats.faster_than_torch(1, vs_torch).passed
    left_out = sweep_stats.faster_than_torch(1, vs_torch, torch_nonfinite={"nan"})
    assert left_out.passed and "faster on 1 of 1" in left_out.measured and "non-finite: nan" in left_out.measured
    # gradsync's own non-finite weights fail the shape however fast it was.
    assert not sweep_stats.faster_than_torch(1, vs_torch, torch_nonfinite={"nan"}, ours_nonfinite={"a"}).passed


def test_hook_target_names_the_cpu_floor() -> None:
    target = sweep_stats.hook_target({"h": {"a": 1.3, "b": 1.4}}, cpu_floor=1.25)
    assert not target.passed and target.measured == "h: 1.350 (its CPU alone, no link: 1.250)"


def test_report_says_under_load_only_when_measured() -> None:
    from types import SimpleNamespace

    from benchmarks.lib import sweep_report

    def result(name: str, other_cores: float) -> sweep_report.ShapeResult:
        return sweep_report.ShapeResult(name, "", 1, 1, 4, 2, {}, other_cores=other_cores)

    quiet_load = SimpleNamespace(other_cores=lambda: 0.05)
    quiet = sweep_report.load_verdict([result("a", 0.0), result("b", 0.03)], quiet_load)  # type: ignore[arg-type]
    assert quiet.startswith("**Quiet run**") and "0.03 cores" in quiet
    loaded = sweep_report.load_verdict([result("a", 0.0), result("b", 0.9)], quiet_load)  # type: ignore[arg-type]
    assert "shared the 2 cores" in loaded and "(1 of 2 shapes" in loaded
    busy_load = SimpleNamespace(other_cores=lambda: 0.5)  # between the shapes, say
    assert "shared" in sweep_report.load_verdict([result("a", 0.0)], busy_load)  # type: ignore[arg-type]


def test_grid_spans_the_issue_ranges() -> None:
    grid = shapes.GRID
    assert len({s.name for s in grid}) == len(grid) >= 24
    gpts = [s for s in grid if isinstance(s, shapes.GPTShape)]
    assert {s.batch for s in gpts} == {1, 2, 4}
    assert min(s.vocab for s in gpts) == 2048 and max(s.vocab for s in gpts) == 32768
    assert min(s.width for s in gpts) == 128 and max(s.width for s in gpts) == 512
    assert min(s.layers for s in gpts) == 2 and max(s.layers for s in gpts) == 8
    assert {s.tied for s in gpts} == {True, False}
    assert any(isinstance(s, shapes.MLPShape) for s in grid) and any(isinstance(s, shapes.ConvShape) for s in grid)


def test_a_shape_is_a_pure_function_of_its_parameters() -> None:
    shape = shapes.GPTShape(1, 2048, 128, 2, tied=True)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(shapes.workload(shapes.GPTShape(1, 2048, 128, 2, tied=True)).build())
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        assert torch.equal(a, b), name
    batches = [shapes.workload(shape).make_batch(torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(batches[0][0], batches[1][0]) and batches[0][0].shape == (1, shapes.SEQ)


def test_tied_head_shares_the_embedding() -> None:
    torch.manual_seed(0)
    tied = shapes.workload(shapes.GPTShape(1, 2048, 128, 2, tied=True)).build()
    untied = shapes.workload(shapes.GPTShape(1, 2048, 128, 2, tied=False)).build()
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 2048 * 128  # the head's weight, counted once when tied
    assert tied.head.weight is tied.tokens.weight


def test_tight_bound_starts_at_the_first_gradient() -> None:
    samples = two_rounds()
    samples[sweep_stats.FIRST_GRADIENT] = [1.5, 1.5, 3.0, 3.0]  # later than forward: 1.5 + 2.5 = 4, 3 + 2 = 5
    assert sweep_stats.bound_series(samples, 2, start=sweep_stats.FIRST_GRADIENT) == [4.0, 4.0, 5.0, 5.0]


def predecessors(orders: list[list[str]]) -> dict[str, set[str]]:
    """Which contender ran right before each, over consecutive rounds (a round's last before the next's first)."""
    sequence = [name for order in orders for name in order]
    seen: dict[str, set[str]] = {name: set() for name in sequence}
    for before, after in zip(sequence, sequence[1:]):
        seen[after].add(before)
    return seen


def test_shuffled_rounds_give_each_contender_many_neighbours_where_rotation_gives_two() -> None:
    from benchmarks.lib.common import Contender, round_order  # imports gradsync: inside the test

    names = [f"c{i}" for i in range(8)]
    contenders = [Contender(name, lambda i: None) for name in names]
    rotated = [[c.name for c in round_order(contenders, r, shuffle=False)] for r in range(15)]
    shuffled = [[c.name for c in round_order(contenders, r, shuffle=True)] for r in range(15)]
    assert all(sorted(order) == names for order in rotated + shuffled)  # every contender once per round
    # Negative control: rotated, c1 always follows c0, except where it opens a round (after c7, the last before)
    assert predecessors(rotated)["c1"] == {"c0", "c7"}
    assert all(len(p) >= 4 for p in predecessors(shuffled).values())
    # Seeded by the round alone: every rank, and every call, draws the same order
    again = [[c.name for c in round_order(contenders, r, shuffle=True)] for r in range(15)]
    assert again == shuffled


def test_the_aa_control_is_put_through_the_same_tests_as_gradsync() -> None:
    # Torch against its second instance: an interval wholly above 1 is the test's own false alarm, named.
    exact = {"a": (1.0, 0.95, 1.05), "b": (1.04, 1.01, 1.08)}
    hook = {"a": (0.97, 0.9, 1.02), "b": (1.01, 0.95, 1.06), "nan": (1.5, 1.4, 1.6)}
    slower, faster = sweep_stats.control_targets(exact, hook, torch_nonfinite={"nan"})
    assert not slower.passed and slower.measured == "slower on 1: b"
    assert slower.what.startswith("torch DDP (a second instance) no slower than torch DDP")
    assert not faster.passed and faster.measured.startswith("faster on 1 of 2") and "not on b" in faster.measured
    assert "left out, torch's weights non-finite: nan" in faster.measured
    # Negative control: the same code agreeing with itself on every shape passes both tests.
    same = {"a": (0.99, 0.95, 1.03)}
    assert all(t.passed for t in sweep_stats.control_targets(same, same))


def test_every_control_is_a_described_contender_of_the_sweep() -> None:
    from benchmarks.lib import contenders, sweep_report

    for reference, again in sweep_stats.CONTROLS.items():
        assert again == reference + contenders.AGAIN and again in sweep_report.CONTENDERS
        assert reference in sweep_report.CONTENDERS and again in sweep_report.DESCRIPTIONS


def test_even_odds_ratio_by_hand() -> None:
    # Log ratios +-0.05: sd 0.05. Two shapes: z = Phi^-1(sqrt(0.5)) = 0.5449, so exp(-0.5449 * 0.05).
    import math

    control = {"a": (math.exp(0.05), 0.0, 0.0), "b": (math.exp(-0.05), 0.0, 0.0)}
    spread, needed = sweep_stats.even_odds_ratio(control)
    assert spread == pytest.approx(0.05) and needed == pytest.approx(math.exp(-0.5449 * 0.05), abs=1e-4)
    # More shapes at the same spread ask for more: 24 of them, z = Phi^-1(0.5 ** (1 / 24)) = 1.9038.
    many = {f"s{k}": (math.exp(0.05 if k % 2 else -0.05), 0.0, 0.0) for k in range(24)}
    assert sweep_stats.even_odds_ratio(many)[1] == pytest.approx(math.exp(-1.9038 * 0.05), abs=1e-4)
    # Negative control: no spread, no advantage needed.
    assert sweep_stats.even_odds_ratio({"a": (1.0, 0.0, 0.0), "b": (1.0, 0.0, 0.0)}) == (0.0, 1.0)


def test_pooled_ratio_by_hand() -> None:
    import math

    # Two shapes, 2 iterations a round. Round ratios of medians: 1.1 and 1.1 (shape a), 0.9 and 1.0 (shape b).
    a = ([1.1, 1.1, 2.2, 2.2], [1.0, 1.0, 2.0, 2.0], 2)
    b = ([0.9, 0.9, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0], 2)
    ratio, low, high = sweep_stats.pooled_ratio([a, b])
    logs = [math.log(1.1), math.log(1.1), math.log(0.9), 0.0]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert ratio == pytest.approx(math.exp(mean))
    assert (low, high) == (pytest.approx(math.exp(mean - 1.96 * sd / 2)), pytest.approx(math.exp(mean + 1.96 * sd / 2)))
    # Negative control: a contender equal to its reference in every round pools to exactly 1.
    assert sweep_stats.pooled_ratio([(a[1], a[1], 2), (b[1], b[1], 2)]) == (1.0, 1.0, 1.0)
