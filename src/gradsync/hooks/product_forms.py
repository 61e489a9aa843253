"""Which form of PowerSGD's rank-local products to issue: chosen on this machine, by timing, once per shape.

[Note: forms chosen on the machine]
A product can be issued in several forms of the same arithmetic ([Note: the forms of a stack's
products] in low_rank.py), and on CPU which one is fastest depends on the CPU's kernels, not only
on the rank and the size: ``P = M Q`` at rank 4 through transposed operands, ``(Q^T M^T)^T``, was
3.9-4.2x faster than the batched ``M Q`` on two machines (one of them AVX2) and 3.6-4.2x slower on
a third (AVX512), on the same stacks (benchmarks/results/2026-12-07-product-forms*.md). A rule
fixed on one machine gives that away on another. So the products that stay on this rank -- ``P =
M Q``, ``Q = M^T P`` and the error-feedback residual ``M -= P Q^T`` -- are issued in the form that
timed fastest here: the first call with a new (product, stack shape, rank, dtype) times each form
on scratch copies of its operands (a few milliseconds, once per shape for the life of the hook's
state), and a form other than the listed default (low_rank.py's) is kept only if it beat the
default by ``MARGIN``, so that timing noise does not pick between near-equals.

What is never chosen this way: the output ``P Q^T``. Every rank computes it from the same summed
``P`` and ``Q`` and must write the same bits, or the replicas drift apart; it keeps its fixed form
(``write_product``). The rank-local products may differ between ranks, because what they produce
is summed before it is used: every rank receives the same sum.

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

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
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


class ProductForms:
    """The form of each rank-local product, per stack shape, for one hook state ([Note: forms chosen on the machine]).

    ``measure`` times a dict of forms (None: this module's ``measure``, looked up when a choice is
    made; tests script it); ``chosen`` maps each measured (product, shape, rank, dtype) to the name
    of the form in use.
    """

    def __init__(self, measure: Measure | None = None, margin: float = MARGIN) -> None:
        self._measure = measure
        self.margin = margin
        self.chosen: dict[tuple[str, tuple[int, ...], int, torch.dtype], str] = {}
        self._cached: dict[tuple[str, tuple[int, ...], int, torch.dtype, bool], Product] = {}

    def project(self, m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> None:
        """``p = m q`` for a stack of matrices."""
        self._form("project", m, q, p)(m, q, p)

    def back_project(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``q = m^T p`` for a stack of matrices."""
        self._form("back_project", m, p, q)(m, p, q)

    def subtract_product(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
        """``m -= p q^T`` in place."""
        self._form("subtract_product", m, p, q)(m, p, q)

    def _form(self, product: str, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Product:
        # Called for every stack of every bucket: the cached case first, in as few steps as it takes
        # (microseconds count on the smallest stacks, whose products take 5-10 us).
        if torch.are_deterministic_algorithms_enabled():
            return FORMS[product]["default"]
        key = (product, m.shape, a.shape[-1], m.dtype, m.is_cpu)
        form = self._cached.get(key)
        if form is None:
            if m.is_cpu:
                self.chosen[key[:4]] = name = self._choose(product, m, a, b)
            else:
                name = "default"
            form = self._cached[key] = FORMS[product][name]
        return form

    def _choose(self, product: str, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str:
        """Time every form on scratch operands of these shapes (never the live ones: the residual
        updates ``m`` in place) and keep the default unless another beats it by ``margin``."""
        scratch = (m.clone(), a.clone(), b.clone())

        def on_scratch(form: Product) -> Callable[[], None]:
            return lambda: form(*scratch)

        times = (self._measure or measure)({name: on_scratch(form) for name, form in FORMS[product].items()})
        fastest = min(times, key=times.__getitem__)
        return fastest if times[fastest] * self.margin < times["default"] else "default"
