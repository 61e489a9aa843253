"""PowerSGD's rank-local products in the form timed fastest on this machine ([Note: forms chosen on the machine]).

Every form against a float64 reference product; the choice (margin, once per shape, scratch operands,
the defaults under deterministic algorithms) with a scripted clock; and the hook on 2 ranks with each
form forced, against the hand references of tests/test_hooks_library.py, and with the two ranks
forced to different forms, whose replicas must still receive the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradsync.hooks import PowerSGDState, powersgd, powersgd_hook, product_forms
from gradsync.hooks.product_forms import FORMS, ProductForms
from test_hooks_library import Buckets, W, _check_powersgd_stacks_same_shaped_matrices, _grad, _run

from harness import run_distributed

pytestmark = pytest.mark.timeout(120)

# (k, rows, cols, r): small and large stacks (either side of low_rank's SMALL_RESIDUAL), ranks 1 and 4
CASES = [(3, 6, 4, 1), (2, 64, 96, 1), (2, 64, 96, 4), (1, 20, 200, 2)]


def _operands(k: int, rows: int, cols: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(k * rows + cols + r)
    return (
        torch.randn(k, rows, cols, generator=generator),
        torch.randn(k, rows, r, generator=generator),
        torch.randn(k, cols, r, generator=generator),
    )


@pytest.mark.parametrize("k, rows, cols, r", CASES)
def test_every_form_computes_its_product(k: int, rows: int, cols: int, r: int) -> None:
    m, p, q = _operands(k, rows, cols, r)
    m64, p64, q64 = m.double(), p.double(), q.double()
    expected = {
        "project": m64 @ q64,
        "back_project": m64.transpose(-2, -1) @ p64,
        "subtract_product": m64 - p64 @ q64.transpose(-2, -1),
    }
    for product, forms in FORMS.items():
        assert "default" in forms and len(forms) >= 2, product
        for name, form in forms.items():
            if product == "project":
                result = torch.full_like(p, float("nan"))
                form(m, q, result)
            elif product == "back_project":
                result = torch.full_like(q, float("nan"))
                form(m, p, result)
            else:
                result = m.clone()
                form(result, p, q)
            error = (result.double() - expected[product]).abs().max()
            assert error < 1e-4, (product, name, error)


def _scripted(times: dict[str, float], calls: list[list[str]]):  # noqa: ANN202
    """A measure that runs every form once (as timing would) and reports the given times."""

    def measure(forms: dict) -> dict[str, float]:  # noqa: ANN001
        calls.append(sorted(forms))
        for form in forms.values():
            form()
        return {name: times.get(name, 1.0) for name in forms}

    return measure


def test_another_form_replaces_the_default_only_when_faster_by_the_margin() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    out = torch.empty_like(p)
    for alternative, chosen in ((1.0 / 1.3, "M Q"), (1.0 / 1.2, "default"), (1.5, "default")):
        calls: list[list[str]] = []
        forms = ProductForms(_scripted({"M Q": alternative}, calls), margin=1.25)
        forms.project(m, q, out)  # the first call: the default, untimed (the random initial Q)
        assert calls == [] and forms.chosen == {}
        forms.project(m, q, out)  # timed at the second call (the warm-start Q) ...
        forms.project(m, q, out)  # ... and not again
        assert calls == [["M Q", "default"]]
        assert forms.chosen == {("project", (2, 64, 96), 4, torch.float32): chosen}
        assert torch.allclose(out, m @ q, atol=1e-4)
    # A new shape or rank is measured on its own.
    calls = []
    forms = ProductForms(_scripted({}, calls))
    for _ in range(2):
        forms.project(m, q, out)
        forms.project(m[:1], q[:1], out[:1])
        forms.project(m, q[..., :2].contiguous(), out[..., :2].contiguous())
    assert len(calls) == 3 and len(forms.chosen) == 3


class _Clock:
    """A clock each live call of a form advances by ``call_s`` (measure's own timings are scripted apart)."""

    def __init__(self, call_s: float) -> None:
        self.now, self.call_s, self.reads = 0.0, call_s, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the read after a call
            self.now += self.call_s
        return self.now


@pytest.mark.parametrize("live_s, retimed", [(0.5 * 10, True), (0.5 * 4, False)], ids=["slowed_10x", "slowed_4x_kept"])
def test_a_form_that_slows_down_on_live_data_is_timed_again(live_s: float, retimed: bool) -> None:
    """[Note: a form that slows down on the data]: M Q timed at 0.5 s a call, then taking 5 s on the
    live operands (a denormal slow path) three calls in a row, is timed again and dropped; 2 s (a
    cold cache, a busy core) is below the bar and kept."""
    m, p, q = _operands(2, 64, 96, 4)
    script = [{"default": 1.0, "M Q": 0.5}, {"default": 1.0, "M Q": 8.0}]
    calls: list[dict[str, float]] = []

    def measure(forms: dict) -> dict[str, float]:  # noqa: ANN001
        calls.append(script[len(calls)])
        return calls[-1]

    forms = ProductForms(measure, clock=_Clock(live_s))
    out = torch.empty_like(p)
    for _ in range(1 + product_forms._SLOW_STREAK + 2):
        forms.project(m, q, out)
        assert torch.allclose(out, m @ q, atol=1e-4)
    assert len(calls) == (2 if retimed else 1)
    assert forms.chosen == {("project", (2, 64, 96), 4, torch.float32): "default" if retimed else "M Q"}


def test_only_slow_calls_in_a_row_time_a_form_again() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    calls: list[list[str]] = []
    durations = iter([0.0] + [1.0, 1.0, 1e-9] * 5 + [1.0] * 3)  # slow, slow, fast, ...: then three slow

    class Clock:
        now = 0.0
        reads = 0

        def __call__(self) -> float:
            Clock.reads += 1
            if Clock.reads % 2 == 0:
                Clock.now += next(durations)
            return Clock.now

    forms = ProductForms(_scripted({"M Q": 1e-3}, calls), clock=Clock())
    for _ in range(1 + 15):
        forms.project(m, q, torch.empty_like(p))
    assert len(calls) == 1  # the streak never reached three
    for _ in range(3):
        forms.project(m, q, torch.empty_like(p))
    assert len(calls) == 2


def test_a_shape_is_timed_again_at_most_max_timings_times() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    calls: list[list[str]] = []
    forms = ProductForms(_scripted({"M Q": 1e-9}, calls), clock=_Clock(1.0))  # always far slower than timed
    for _ in range(product_forms._SLOW_STREAK * (product_forms._MAX_TIMINGS + 3)):
        forms.project(m, q, torch.empty_like(p))
    assert len(calls) == product_forms._MAX_TIMINGS


def test_the_residual_is_timed_on_scratch_and_applied_once() -> None:
    """Timing runs the in-place residual many times: on copies, never on the live error memory."""
    m, p, q = _operands(2, 64, 96, 1)
    live, expected = m.clone(), m - p @ q.transpose(-2, -1)
    forms = ProductForms(_scripted({"M^T -= Q P^T": 0.1}, []))
    forms.subtract_product(m.clone(), p, q)  # the first call: untimed
    forms.subtract_product(live, p, q)
    assert forms.chosen == {("subtract_product", (2, 64, 96), 1, torch.float32): "M^T -= Q P^T"}
    assert torch.allclose(live, expected, atol=1e-5), (live - expected).abs().max()


def test_deterministic_algorithms_keep_the_defaults_unmeasured() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    calls: list[list[str]] = []
    forms = ProductForms(_scripted({"M Q": 0.01, "M^T P": 0.01, "M -= P Q^T": 0.01}, calls))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out = torch.empty_like(p)
        forms.project(m, q, out)
        forms.back_project(m, p, torch.empty_like(q))
        forms.subtract_product(m.clone(), p, q)
        forms.project(m, q, out)
    finally:
        torch.use_deterministic_algorithms(was)
    assert calls == [] and forms.chosen == {}
    forms.project(m, q, out)  # negative control: the same calls measure once they are off
    forms.project(m, q, out)
    assert calls == [["M Q", "default"]]


def test_the_real_measure_times_every_form() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    ran = {"default": 0, "M Q": 0}

    def counted(name: str):  # noqa: ANN202
        def run() -> None:
            ran[name] += 1
            FORMS["project"][name](m, q, torch.empty_like(p))

        return run

    times = product_forms.measure({name: counted(name) for name in ran})
    assert set(times) == set(ran) and all(0 < t < 1 for t in times.values()), times
    assert all(count >= 2 + 1 + product_forms._ROUNDS for count in ran.values()), ran


def _forcing(pick: int):  # noqa: ANN202
    """A measure under which each product's ``pick``-th form (0: the default) is by far the fastest."""

    def measure(forms: dict) -> dict[str, float]:  # noqa: ANN001
        names = list(forms)
        fastest = names[min(pick, len(names) - 1)]
        return {name: 0.001 if name == fastest else 1.0 for name in names}

    return measure


def _check_with_forms_forced(pick: int, small: int | None) -> None:
    # Every state the check builds gets timed forms under this measure (workers are reused: undone after).
    powersgd.ProductForms = lambda timed: ProductForms(_forcing(pick), first_timing=1)
    try:
        _check_powersgd_stacks_same_shaped_matrices(small)
    finally:
        powersgd.ProductForms = ProductForms


def test_untimed_forms_are_the_fixed_defaults() -> None:
    m, p, q = _operands(2, 64, 96, 4)
    for timed in (False, True):
        calls: list[list[str]] = []
        forms = ProductForms(_scripted({"M Q": 1e-3}, calls), timed=timed)
        for _ in range(3):
            forms.project(m, q, torch.empty_like(p))
        assert (calls == [["M Q", "default"]]) == timed and bool(forms.chosen) == timed


@pytest.mark.parametrize("pick", [1, 2], ids=["first_other_form", "second_other_form"])
@pytest.mark.parametrize("small", [None, 0], ids=["small_forms", "large_forms"])
def test_powersgd_with_every_other_form_forced_matches_the_hand_references(pick: int, small: int | None) -> None:
    run_distributed(_check_with_forms_forced, W, pick, small)


def _check_ranks_on_different_forms() -> None:
    rank = dist.get_rank()
    assert not PowerSGDState(None).forms.timed and PowerSGDState(None, time_product_forms=True).forms.timed
    make = Buckets([(64, 96), (96,), (64, 96), (40, 30)])
    numel = 2 * 64 * 96 + 96 + 40 * 30
    state = PowerSGDState(None, matrix_approximation_rank=2, start_iter=2)  # error feedback, warm start
    state.forms = ProductForms(_forcing(0 if rank == 0 else 1))
    results = []
    for step in range(6):  # compressing from the third
        results.append(_run(powersgd_hook, state, make(_grad(step, rank, numel))))
    names = sorted(set(state.forms.chosen.values()))
    gathered_names: list[list[str] | None] = [None] * W
    dist.all_gather_object(gathered_names, names)
    assert gathered_names == [["default"], ["M -= P Q^T", "M Q", "M^T P"]], gathered_names  # not vacuous
    for result in results:
        everyone = [torch.empty_like(result) for _ in range(W)]
        dist.all_gather(everyone, result)
        assert torch.equal(everyone[0], everyone[1]), (everyone[0] - everyone[1]).abs().max()


def test_ranks_on_different_forms_still_get_the_same_bits() -> None:
    """Only the rank-local products are chosen per rank; what they feed is summed, and the output
    product (the same on every rank) keeps its fixed form: replicas receive identical gradients."""
    run_distributed(_check_ranks_on_different_forms, W)
