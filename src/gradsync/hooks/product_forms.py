"""Which form of PowerSGD's rank-local products to issue: chosen on this machine, by timing, once per shape.

[Note: forms chosen on the machine]
A product can be issued in several forms of the same arithmetic ([Note: the forms of a stack's
products] in low_rank.py), and on CPU which one is fastest depends on the CPU's kernels, not only
on the rank and the size: ``P = M Q`` at rank 4 through transposed operands, ``(Q^T M^T)^T``, was
3.9-4.2x faster than the batched ``M Q`` on two machines (one of them AVX2) and 3.6-4.2x slower on
a third (AVX512), on the same stacks (benchmarks/results/2026-12-07-product-forms*.md). A rule
fixed on one machine gives that away on another. So the products that stay on this rank -- ``P =
M Q``, ``Q = M^T P`` and the error-feedback residual ``M -= P Q^T`` -- can be issued in the form that
timed fastest here (off by default, below): the second call with a new (product, stack shape, rank,
dtype) times each form on scratch copies of its operands (a few milliseconds, once per shape; again
only if the form slows down a great deal on later data: [Note: a form that slows down on the data]),
and a form other than the listed default (low_rank.py's) is kept only if it beat the default by
``MARGIN``, so that timing noise does not pick between near-equals.

What is never chosen this way: the output ``P Q^T``. Every rank computes it from the same summed
``P`` and ``Q`` and must write the same bits, or the replicas drift apart; it keeps its fixed form
(``write_product``). The rank-local products may differ between ranks, because what they produce
is summed before it is used: every rank receives the same sum.

Off by default (``PowerSGDState(time_product_forms=True)`` turns it on). On the AVX512 machine it
cut the hook's CPU at world size 1 (rank 4: 3-5 ms a step on four of six shapes) and sped up the
A/Bs of some shapes at world size 2, yet the parity study there, four instances a side against
torch's hook, came out worse than with the fixed forms (pooled 0.966 against 0.949, four shapes
slower against none; docs/performance.md): what a form costs in a short timing is not what it costs
in a step, nor on tomorrow's data (below), and the fixed forms are the known quantity.

Determinism: the forms add the same products in another order, so a different choice changes the
last bits of ``P``, and with them of the weights. Two runs on one machine choose alike unless two
forms time within noise of the margin. Under ``torch.use_deterministic_algorithms(True)``, and
on devices other than the CPU (where the forms were not measured), the fixed defaults are used.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from . import low_rank

MARGIN = 1.25  # another form replaces the default only when at least this much faster
_ROUNDS = 3  # each form's time: the best of this many blocks, the forms taking turns
_BLOCK_S = 100e-6  # a block repeats a form about this long (at most _MAX_CALLS calls)
_MAX_CALLS = 50
# [Note: a form that slows down on the data]
# What a product costs depends on the values too: on a deep tanh MLP the warm-start Q of a layer whose
# gradient has all but vanished is tiny, so M Q underflows, and a kernel that meets denormal numbers slows
# down, some far more than others (84 x (128 x 128) at rank 4 on the AVX512 machine: the batched M Q 0.56 ms
# on random data and 20 ms on such data, (Q^T M^T)^T 1.9 and 7.5 ms). So a shape's forms are timed at its
# second call, on that call's operands (the first compressing iteration runs the default with the random
# initial Q; the second has the warm-start Q), and again, on the operands of the call, after _SLOW_STREAK
# live calls in a row took SLOWDOWN times the timing (and _SLOWDOWN_FLOOR_S more), at most _MAX_TIMINGS
# times per shape. The bar is high and must hold for calls in a row because a live call also differs from
# the timing for reasons no other form fixes: a stack that is no longer in cache, the other rank's threads
# on the same cores (with a bar of 3x and one call, the embedding stack of gpt_b2_v16k_d128_L2_untied was
# timed five times in 13 steps).
SLOWDOWN = 8.0
_SLOWDOWN_FLOOR_S = 200e-6
_SLOW_STREAK = 3
_MAX_TIMINGS = 4

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
_Key = tuple[str, tuple[int, ...], int, torch.dtype, bool]  # product, stack shape, rank, dtype, on CPU
Measure = Callable[[dict[str, Callable[[], None]]], dict[str, float]]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _project_plain(m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> None:
    torch.matmul(m, q, out=p)


def _back_project_plain(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    torch.matmul(_t(m), p, out=q)


def _subtract_plain(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    m.baddbmm_(p, _t(q), alpha=-1)


def _subtract_transposed(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    _t(m).baddbmm_(q, _t(p), alpha=-1)


# Per product: the default (low_rank.py's rule, as fixed on the first machine) first, then the others.
# Each writes its result into its third operand (``p``, ``q``), or updates ``m`` in place.
FORMS: dict[str, dict[str, Product]] = {
    "project": {"default": low_rank.project, "M Q": _project_plain},
    "back_project": {"default": low_rank.back_project, "M^T P": _back_project_plain},
    "subtract_product": {
        "default": low_rank.subtract_product,
        "M -= P Q^T": _subtract_plain,
        "M^T -= Q P^T": _subtract_transposed,
    },
}


def measure(forms: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Seconds per call of each form: the best of ``_ROUNDS`` blocks, the forms taking turns."""
    for form in forms.values():  # first calls allocate and pick kernels
        form()
        form()
    calls = {}
    for name, form in forms.items():
        start = time.perf_counter()
        form()
        once = max(time.perf_counter() - start, 1e-7)
        calls[name] = max(1, min(_MAX_CALLS, round(_BLOCK_S / once)))
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(_ROUNDS):
        for name, form in forms.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                form()
            best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return best


class _Choice:
    """One (product, stack shape, rank, dtype)'s form in use, and what it was timed at."""

    __slots__ = ("name", "form", "expected_s", "calls", "slow", "timings")

    def __init__(self, product: str) -> None:
        self.name, self.form = "default", FORMS[product]["default"]
        self.expected_s = float("inf")  # not timed yet
        self.calls = 0
        self.slow = 0  # live calls in a row that took SLOWDOWN times the timing
        self.timings = 0


class ProductForms:
    """The form of each rank-local product, per stack shape, for one hook state ([Note: forms chosen on the machine]).

    ``measure`` times a dict of forms (None: this module's ``measure``, looked up when a choice is
    made; tests script it) and ``clock`` each live call (tests script it too); ``chosen`` maps each
    measured (product, shape, rank, dtype) to the name of the form in use.
    """

    def __init__(
        self,
        measure: Measure | None = None,
        margin: float = MARGIN,
        clock: Callable[[], float] = time.perf_counter,
        timed: bool = True,
        first_timing: int = 2,
    ) -> None:
        self.timed = timed  # False: the fixed defaults, never timed (PowerSGDState's default)
        self.first_timing = first_timing  # the call of a shape at which its forms are first timed
        self._measure = measure
        self.margin = margin
        self._clock = clock
        self.chosen: dict[tuple[str, tuple[int, ...], int, torch.dtype], str] = {}
        self._choices: dict[_Key, _Choice] = {}

    def project(self, m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> None:
        """``p = m q`` for a stack of matrices."""
        self._run("project", m, q, p)

    def back_project(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``q = m^T p`` for a stack of matrices."""
        self._run("back_project", m, p, q)

    def subtract_product(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``m -= p q^T`` in place."""
        self._run("subtract_product", m, p, q)

    def _run(self, product: str, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        # Called for every stack of every bucket: the common case in as few steps as it takes
        # (microseconds count on the smallest stacks, whose products take 5-10 us).
        if not self.timed or torch.are_deterministic_algorithms_enabled() or not m.is_cpu:
            FORMS[product]["default"](m, a, b)
            return
        key = (product, m.shape, a.shape[-1], m.dtype, True)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = _Choice(product)
        if choice.timings == 0 and choice.calls + 1 >= self.first_timing:  # [Note: a form that slows down ...]
            self._time(choice, key, m, a, b)
        start = self._clock()
        choice.form(m, a, b)
        elapsed = self._clock() - start
        choice.calls += 1
        if elapsed > SLOWDOWN * choice.expected_s + _SLOWDOWN_FLOOR_S:
            choice.slow += 1
            if choice.slow >= _SLOW_STREAK and choice.timings < _MAX_TIMINGS:
                self._time(choice, key, m, a, b)
        else:
            choice.slow = 0

    def _time(self, choice: _Choice, key: _Key, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Time every form on scratch operands of these shapes and values (never the live ones: the
        residual updates ``m`` in place); keep the default unless another beats it by ``margin``."""
        product = key[0]
        scratch = (m.clone(), a.clone(), b.clone())

        def on_scratch(form: Product) -> Callable[[], None]:
            return lambda: form(*scratch)

        times = (self._measure or measure)({name: on_scratch(form) for name, form in FORMS[product].items()})
        fastest = min(times, key=times.__getitem__)
        choice.name = fastest if times[fastest] * self.margin < times["default"] else "default"
        choice.form, choice.expected_s = FORMS[product][choice.name], times[choice.name]
        choice.slow, choice.timings = 0, choice.timings + 1
        self.chosen[key[:4]] = choice.name
