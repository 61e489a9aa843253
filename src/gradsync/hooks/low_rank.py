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


# [Note: when a stack is batched]
# Stacking pays where a matrix is small and each operation's dispatch costs more than its flops. For
# larger matrices torch's CPU batched products are slower than one product per matrix, and the size
# where that turns differs by product (measured on one core, 16 stacked matrices, batched against one by
# one): ``P = M Q`` (a matrix times a vector at rank 1) 20 against 19 us at 32 x 32, 58 against 26 us at
# 64 x 64, 1139 against 130 us at 256 x 256; the output ``P Q^T`` 9 against 35 us at 32 x 32, 59 against
# 58 us at 128 x 128, 203 against 134 us at 256 x 256; the residual ``M - P Q^T`` batched was as fast or
# faster up to 256 x 256. So ``P = M Q`` is batched for matrices of up to ``SMALL_PRODUCT`` elements,
# the output and the residual up to ``SMALL_MATRIX``; larger stacks go a matrix at a time (their QR
# batched all the same: that call is cheap either way). One matrix at a time, ``P = M Q`` at rank 2 or
# more is computed as ``(Q^T M^T)^T``: torch's CPU product of a row-major matrix by a thin one is 4-5x
# slower than the same product with both operands transposed (one core, 2026-12-07: 122 against 25 us
# at 128 x 1152, rank 4; 152 against 36 us at 768 x 256; 37 against 11 us at 384 x 128; at rank 1,
# a matrix times a vector, the plain product is the faster, 7.5 against 10 us at 128 x 1152).
SMALL_PRODUCT = 32 * 32
SMALL_MATRIX = 128 * 128


def batch_of(stack: torch.Tensor, limit: int = SMALL_MATRIX) -> int:
    """How many of ``stack``'s matrices one operation takes: all when they have at most ``limit`` elements,
    else one. See [Note: when a stack is batched]."""
    return stack.shape[0] if stack.shape[-2] * stack.shape[-1] <= limit else 1


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
        for m, p, q in zip(matrices, self.ps, self.qs):
            b = batch_of(m, SMALL_PRODUCT)
            for m_part, p_part, q_part in zip(m.split(b), p.split(b), q.split(b)):
                if b == 1 and q_part.shape[-1] > 1:  # [Note: when a stack is batched]: P^T = Q^T M^T at rank 2 or more
                    p_part.copy_(torch.matmul(q_part.transpose(-2, -1), m_part.transpose(-2, -1)).transpose(-2, -1))
                else:
                    torch.matmul(m_part, q_part, out=p_part)
        state.wire.add_all_reduce(self.p_flat)
        self.p_work = dist.all_reduce(self.p_flat, group=state.process_group, async_op=True)

    def finish(self) -> None:
        """Wait for ``P``, compute and launch ``Q``; the result future completes when ``Q`` is summed."""
        state = self.state
        try:
            self.p_work.wait()
            for p in self.ps:
                orthonormalise(p)
            for m, p, q in zip(self.matrices, self.ps, self.qs):
                # Q = M^T P, computed as (P^T M)^T: reading M row-major is ~10x faster on CPU than
                # through the transposed view. Overwrites the Q the P came from (warm start keeps it).
                q.copy_(torch.matmul(p.transpose(-2, -1), m).transpose(-2, -1))
                if state.use_error_feedback:  # M - P Q^T in place, without a temporary
                    b = batch_of(m)
                    for m_part, p_part, q_part in zip(m.split(b), p.split(b), q.split(b)):
                        m_part.baddbmm_(p_part, q_part.transpose(-2, -1), alpha=-1)
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
            self.result.set_result(self.write(self.ps, self.qs, self.carried))
        except Exception as error:  # noqa: BLE001 - handed to whoever waits for the bucket
            self.result.set_exception(error)  # type: ignore[arg-type]  # as in finish
