"""PowerSGD's power-iteration round, split in two around the ``P`` all-reduce.

[Note: P in flight]
A round is ``P = M Q; all-reduce P; orthonormalise P; Q = M^T P; all-reduce Q``. Its second
half needs the summed ``P``, so a hook that ran the whole round at once would wait for ``P``
in the middle of backward: on a slow link the wait is the other rank's lag plus the link's
latency, paid once per bucket. Instead constructing a ``LowRankRound`` computes the local ``P``
and launches its all-reduce, and ``finish`` (the second half) runs at the hook's *next* call,
when backward has produced the next bucket and ``P`` has usually arrived; the last bucket of
a pass finishes at once. Every collective is still issued by the hook itself, on the thread
that launches buckets in index order (see [Note: collective order] in powersgd.py), so
every rank issues ``P0, Q0 P1, Q1 P2, ...`` in the same order.

A round left waiting when no further bucket comes (the last buckets skipped as unused, or
no launches after a failed collective) is finished by ``finish_launches``, which gradsync's
reducer calls once every bucket of a pass was launched or skipped; a round still waiting when
a new pass starts (this rank's backward raised) is failed, not finished, since the other
ranks cannot be issuing its ``Q``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .denormals import flushed_denormals


def orthonormalise(p: torch.Tensor) -> None:
    """Replace the columns of ``p`` (a matrix, or a stack of them) by an orthonormal basis of their span, in place.

    QR rather than Gram-Schmidt: it needs no epsilon for a zero column (a vanished
    gradient), and it runs in fp32 because LAPACK has no half-precision QR. A stack is
    factored in one call, matrix by matrix.
    """
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    q, _ = torch.linalg.qr(work, mode="reduced")
    p.copy_(q)


def views(flat: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive ``(k, rows, cols)`` views of ``flat``."""
    out, offset = [], 0
    for k, rows, cols in shapes:
        out.append(flat[offset : offset + k * rows * cols].view(k, rows, cols))
        offset += k * rows * cols
    return out


# [Note: the forms of a stack's products]
# A round runs four products per stack of same-shaped matrices: ``P = M Q``, ``Q = M^T P``, the residual
# ``M -= P Q^T`` (error feedback) and the output ``P Q^T`` (written to the bucket). On CPU the same product costs up to
# 10x more in one form than in another, and which form wins depends on the rank, the matrix size and the CPU,
# not on the model. The forms below are fixed: the output's always, the other three's by default
# (``PowerSGDState(time_product_forms=True)`` replaces them by forms timed faster on the machine, [Note: forms
# chosen on the machine] in product_forms.py). ``python -m benchmarks product_forms`` times every form
# against the hook's (benchmarks/results/2026-12-07-product-forms.md, the machine these were fixed on: one
# core, microseconds for a stack of k matrices):
#
# - ``P = M Q`` as ``(Q^T M^T)^T`` on the whole stack, at every rank and size: 8 x (512 x 128) 40 at rank 1
#   and 88 at rank 4, against 70 and 148 a matrix at a time (the forms before) and 296 and 362 for ``M Q``
#   batched; 400 x (32 x 32) 43 and 98 against 205 and 256 for ``M Q`` batched (the form before there). On
#   the smallest stacks (16 x (16 x 16), 8 x (10 x 128)) ``M Q`` batched is 2-5 us faster; not worth a branch.
# - ``Q = M^T P`` as ``(P^T M)^T`` on the whole stack: within 10% of the fastest form in every case but
#   the smallest ones (the same form timed twice differs as much), 8 x (128 x 128) at rank 1: 10 against
#   51 a matrix at a time and 96 for ``M^T P`` batched.
# - the residual: ``M.baddbmm_(P, Q^T)`` on the whole stack, except at rank 1 (an outer product) above
#   ``SMALL_RESIDUAL`` elements, where the batched call slows down 3-5x (8 x (128 x 128): 65) and the same
#   update through the transposed view, ``M^T.baddbmm_(Q, P^T)``, does not (19); at rank 4, 8 x (512 x 128):
#   51 against 87 a matrix at a time (the form before above 128 x 128).
# - the output into its view of the bucket (strided when a bias lies between two weights): up to
#   ``SMALL_OUTPUT`` elements one batched product, into the view when it is contiguous and through a
#   temporary when it is not (400 x (32 x 32) strided: 112 against 311 straight into the view); above it
#   straight into the view, as ``(Q P^T)^T`` at rank 1 (8 x (512 x 128) contiguous: 36 against 75).
#
# Every form is the same arithmetic per element (sums of ``r`` or ``rows`` products; only their order may
# differ), issued identically on every rank, so replicas stay bitwise equal. At rank 2 every form of ``P = M Q``
# is about twice as slow as at rank 4 on this CPU (torch's kernel choice; left as it is).
SMALL_RESIDUAL = 2048
SMALL_OUTPUT = 96 * 96


def _numel_each(stack: torch.Tensor) -> int:
    return stack.shape[-2] * stack.shape[-1]


def project(m: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> None:
    """``p = m q`` for a stack of matrices, as ``(q^T m^T)^T`` ([Note: the forms of a stack's products])."""
    p.copy_(torch.matmul(q.transpose(-2, -1), m.transpose(-2, -1)).transpose(-2, -1))


def back_project(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``q = m^T p`` for a stack of matrices, as ``(p^T m)^T`` ([Note: the forms of a stack's products])."""
    q.copy_(torch.matmul(p.transpose(-2, -1), m).transpose(-2, -1))


def subtract_product(m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``m -= p q^T`` in place, without a temporary ([Note: the forms of a stack's products])."""
    if p.shape[-1] == 1 and _numel_each(m) > SMALL_RESIDUAL:
        m.transpose(-2, -1).baddbmm_(q, p.transpose(-2, -1), alpha=-1)
    else:
        m.baddbmm_(p, q.transpose(-2, -1), alpha=-1)


def write_product(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """``out = p q^T``, ``out`` a stack's (possibly strided) view ([Note: the forms of a stack's products])."""
    if _numel_each(out) <= SMALL_OUTPUT:
        if out.is_contiguous():
            torch.matmul(p, q.transpose(-2, -1), out=out)
        else:
            out.copy_(torch.matmul(p, q.transpose(-2, -1)))
    elif p.shape[-1] == 1:
        torch.matmul(q, p.transpose(-2, -1), out=out.transpose(-2, -1))
    else:
        torch.matmul(p, q.transpose(-2, -1), out=out)


def initial_q(state: Any, bucket: GradBucket, numel: int, like: torch.Tensor) -> torch.Tensor:
    if state.warm_start:
        q: torch.Tensor | None = state.q_memory.lookup(bucket)
        if q is not None and q.numel() == numel:
            return q
    q = torch.randn(numel, generator=state.generator).to(device=like.device, dtype=like.dtype)
    if state.warm_start:
        state.q_memory.store(bucket, q)
    return q


class LowRankRound:
    """One bucket's round: the first half at construction, ``finish`` later ([Note: P in flight]).

    ``matrices`` are ``(k, rows, cols)`` stacks of matrices of one shape each ([Note: matrices stacked
    by shape] in matrix_groups.py), overwritten by their local residual when error feedback is on; ``ps``
    and ``qs`` are stacks alike.
    ``passenger``: elements sent uncompressed ride in ``P``'s all-reduce rather than in a
    collective of their own (one latency less per bucket on a slow link). ``write`` turns
    ``(ps, qs, summed passenger)`` into the bucket's result once ``Q`` is summed; ``result``
    is the future the hook returned for the bucket.
    """

    def __init__(
        self,
        state: Any,
        bucket: GradBucket,
        matrices: list[torch.Tensor],
        ranks: list[int],
        passenger: torch.Tensor | None,
        write: Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None], torch.Tensor],
    ) -> None:
        self.state, self.index, self.matrices, self.write = state, bucket.index(), matrices, write
        self.result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        like = matrices[0]
        p_shapes = [(m.shape[0], m.shape[1], r) for m, r in zip(matrices, ranks)]
        q_shapes = [(m.shape[0], m.shape[2], r) for m, r in zip(matrices, ranks)]
        p_numel = sum(k * a * b for k, a, b in p_shapes)
        self.p_flat = like.new_empty(p_numel + (0 if passenger is None else passenger.numel()))
        self.carried = None if passenger is None else self.p_flat[p_numel:]
        if self.carried is not None:
            self.carried.copy_(passenger)  # type: ignore[arg-type]  # carried only with a passenger
        self.q_flat = initial_q(state, bucket, sum(k * a * b for k, a, b in q_shapes), like)
        self.ps, self.qs = views(self.p_flat, p_shapes), views(self.q_flat, q_shapes)
        with flushed_denormals(like.device):  # [Note: denormals in a low-rank round]
            for m, p, q in zip(matrices, self.ps, self.qs):
                state.forms.project(m, q, p)
        state.wire.add_all_reduce(self.p_flat)
        self.p_work = dist.all_reduce(self.p_flat, group=state.process_group, async_op=True)

    def finish(self) -> None:
        """Wait for ``P``, compute and launch ``Q``; the result future completes when ``Q`` is summed."""
        state = self.state
        try:
            self.p_work.wait()
            with flushed_denormals(self.q_flat.device):  # [Note: denormals in a low-rank round]
                for p in self.ps:
                    orthonormalise(p)
                for m, p, q in zip(self.matrices, self.ps, self.qs):
                    state.forms.back_project(m, p, q)  # overwrites the Q the P came from (warm start keeps it)
                    if state.use_error_feedback:
                        state.forms.subtract_product(m, p, q)
            state.wire.add_all_reduce(self.q_flat)
            q_future = dist.all_reduce(self.q_flat, group=state.process_group, async_op=True).get_future()
        except Exception as error:  # noqa: BLE001 - handed to whoever waits for the bucket
            self.result.set_exception(error)  # type: ignore[arg-type]  # torch types it as the result's type
            return
        q_future.then(self._complete)

    def fail(self, why: str) -> None:
        self.result.set_exception(RuntimeError(why))  # type: ignore[arg-type]  # as in finish

    def _complete(self, q_future: torch.futures.Future[Any]) -> None:
        try:
            q_future.value()  # re-raises a failed all-reduce
            with flushed_denormals(self.q_flat.device):  # on whichever thread: [Note: denormals in a low-rank round]
                written = self.write(self.ps, self.qs, self.carried)
            self.result.set_result(written)
        except Exception as error:  # noqa: BLE001 - handed to whoever waits for the bucket
            self.result.set_exception(error)  # type: ignore[arg-type]  # as in finish
