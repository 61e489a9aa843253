"""How ``powersgd_hook`` lays a bucket out for its power iteration: same-shaped matrices stacked.

[Note: matrices stacked by shape]
A model of many small layers (a 400-layer MLP, a deep decoder) gives a bucket hundreds of weight
matrices, and a round runs five or six small operations on each: ``P = M Q``, the QR, ``Q = M^T P``,
the residual, the output. Issued one matrix at a time from Python, each costs a dispatch of a few
microseconds for a few thousand flops, and the hook spends more time launching than computing (on a
400 x (32 x 32) MLP, more than the whole step without communication). Matrices of the same shape
and rank are therefore *stacked*: the hook's working memory (the error-feedback memory, which it
owns and may lay out as it likes) keeps each group of same-shaped matrices contiguous, so the group is
one ``(k, rows, cols)`` tensor and each operation runs once per group, batched. Elements sent
uncompressed (biases, norms, small matrices) sit together at the end, so they travel as one slice.

Moving between the bucket's layout and this one costs no extra pass over the bytes: the pass that
forms ``M = error + bucket / W`` reads the bucket and writes the memory anyway, and the output
``P Q^T`` is written straight to the bucket. Nor does it cost an operation per piece: in a bucket
of repeated layers, same-shaped pieces lie at equal spacing (each block's weight one block after
the last), so each *run* of equally spaced pieces is one strided view of the bucket (``as_strided``)
and moves with one operation. Measured on one core: stacking a 400-matrix bucket's 400 QRs took
them from 2.3 ms to 0.08 ms, its 400 output products written as one strided run from 1.6 ms to
0.6 ms (a temporary and a ``_foreach_copy_`` took 2.4 ms). The arithmetic per
matrix is the same as one matrix at a time; only the order of its floating-point sums may differ
(a batched product), identically on every rank.

The layout depends on the bucket's gradient shapes only, so it is computed once per bucket and kept
while the bucket holds the same parameters ([Note: memories across a bucket rebuild] in memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.grad_bucket import GradBucket
from .low_rank import write_product


def matrix_shape(grad: torch.Tensor) -> tuple[int, int] | None:
    """``(rows, cols)`` to read a gradient as a matrix in memory order; ``None`` for vectors.

    Rows run along the outermost dimension in memory (dim 0 for contiguous tensors, also
    for channels_last), so each row is contiguous in the flat bucket and the matrix is a
    view of it, with the same rank structure as the weight.
    """
    dims = [d for d in range(grad.dim()) if grad.shape[d] > 1]
    if len(dims) < 2:
        return None
    rows = grad.shape[max(dims, key=grad.stride)]
    return rows, grad.numel() // rows


@dataclass(frozen=True)
class Run:
    """``count`` pieces of ``numel`` elements at ``offset``, ``offset + stride``, ... in the bucket, and
    contiguous from ``start`` in the working memory."""

    offset: int
    count: int
    stride: int
    numel: int
    start: int

    def in_bucket(self, buffer: torch.Tensor) -> torch.Tensor:
        """The pieces as a ``(count, numel)`` view of the (flat, contiguous) bucket buffer."""
        return buffer.as_strided((self.count, self.numel), (self.stride, 1), buffer.storage_offset() + self.offset)

    def in_memory(self, memory: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The pieces in ``memory``, a working memory or its part from position ``base`` on."""
        begin = self.start - base
        return memory[begin : begin + self.count * self.numel].view(self.count, self.numel)


def runs_of(pieces: list[tuple[int, int]], start: int) -> list[Run]:
    """Consecutive ``(offset, numel)`` pieces cut into runs of equal size and spacing, laid out from ``start``."""
    runs: list[Run] = []
    for offset, numel in pieces:
        last = runs[-1] if runs else None
        if last is not None and last.numel == numel:
            expected = last.offset + last.count * last.stride if last.count > 1 else None
            if expected == offset or (last.count == 1 and offset >= last.offset + numel):
                stride = offset - last.offset if last.count == 1 else last.stride
                runs[-1] = Run(last.offset, last.count + 1, stride, numel, last.start)
                continue
        begin = last.start + last.count * last.numel if last is not None else start
        runs.append(Run(offset, 1, numel, numel, begin))
    return runs


@dataclass(frozen=True)
class MatrixGroup:
    """``len(offsets)`` matrices of ``rows x cols`` compressed to ``rank``, at ``start`` in the working memory."""

    rows: int
    cols: int
    rank: int
    offsets: tuple[int, ...]  # where each matrix starts in the bucket
    start: int
    runs: tuple[Run, ...]

    @property
    def numel(self) -> int:
        return len(self.offsets) * self.rows * self.cols


class MatrixGroups:
    """A bucket's compressed matrices grouped by (rows, cols, rank), and its uncompressed pieces.

    The working memory holds the groups one after the other, then the plain pieces, grouped by size
    ([Note: matrices stacked by shape]). Every move between the two layouts goes run by run.
    """

    def __init__(self, shapes: list[tuple[int, int, int] | None], numels: list[int]) -> None:
        """``shapes[i]``: ``(rows, cols, rank)`` for a gradient to compress, ``None`` to send it as is."""
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        plain_by_size: dict[int, list[int]] = {}
        offset = 0
        for shape, numel in zip(shapes, numels):
            if shape is None:
                plain_by_size.setdefault(numel, []).append(offset)
            else:
                by_shape.setdefault(shape, []).append(offset)
            offset += numel
        self.numel = offset
        self.groups: list[MatrixGroup] = []
        start = 0
        for (rows, cols, rank), offsets in by_shape.items():
            runs = runs_of([(o, rows * cols) for o in offsets], start)
            self.groups.append(MatrixGroup(rows, cols, rank, tuple(offsets), start, tuple(runs)))
            start += len(offsets) * rows * cols
        self.plain_start = start
        plain = [(o, n) for n, offsets in plain_by_size.items() for o in offsets]
        self.plain_runs = runs_of(plain, start)
        self.plain_numel = sum(n for _, n in plain)
        self.runs = [run for g in self.groups for run in g.runs] + self.plain_runs
        # The views of the last bucket buffer and memory seen, by role: both live from one iteration to the
        # next, and building a view per run from Python each call cost ~2% of a conv net's step.
        self._views: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def _cached(
        self, role: str, tensor: torch.Tensor, make: Callable[[torch.Tensor], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        hit = self._views.get(role)
        if hit is None or hit[0] is not tensor:
            hit = (tensor, make(tensor))
            self._views[role] = hit
        return hit[1]

    def _bucket_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return self._cached("bucket", buffer, lambda t: [run.in_bucket(t) for run in self.runs])

    def _memory_views(self, memory: torch.Tensor) -> list[torch.Tensor]:
        return self._cached("memory", memory, lambda t: [run.in_memory(t) for run in self.runs])

    def _product_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per group and run, the run's matrices as a ``(count, rows, cols)`` strided view of the bucket."""

        def make(t: torch.Tensor) -> list[torch.Tensor]:
            return [
                t.as_strided((run.count, g.rows, g.cols), (run.stride, g.cols, 1), t.storage_offset() + run.offset)
                for g in self.groups
                for run in g.runs
            ]

        return self._cached("products", buffer, make)

    @property
    def has_plain(self) -> bool:
        return self.plain_numel > 0

    def stacks(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """Each group as one ``(k, rows, cols)`` view of the working memory."""
        return [memory[g.start : g.start + g.numel].view(len(g.offsets), g.rows, g.cols) for g in self.groups]

    def plain_part(self, memory: torch.Tensor) -> torch.Tensor:
        return memory[self.plain_start : self.numel]

    def to_memory(self, memory: torch.Tensor, buffer: torch.Tensor, scale: float) -> None:
        """``memory += buffer * scale``, each piece moved to its place in this layout (one pass)."""
        torch._foreach_add_(self._memory_views(memory), self._bucket_views(buffer), alpha=scale)

    def fresh_memory(self, buffer: torch.Tensor, divisor: int) -> torch.Tensor:
        """A new working memory holding ``buffer / divisor`` (each element divided, as the average's terms are)."""
        memory = torch.zeros_like(buffer)
        torch._foreach_copy_([run.in_memory(memory) for run in self.runs], self._bucket_views(buffer))
        return memory.div_(divisor)

    def in_bucket_order(self, memory: torch.Tensor) -> torch.Tensor:
        """A copy of ``memory`` (this layout) with every piece at its place in the bucket."""
        out = torch.zeros_like(memory)
        for run in self.runs:
            run.in_bucket(out).copy_(run.in_memory(memory))
        return out

    def write_products(self, buffer: torch.Tensor, ps: list[torch.Tensor], qs: list[torch.Tensor]) -> None:
        """Each group's ``P Q^T`` straight to its matrices' places in the bucket, one product per run."""
        views = iter(self._product_views(buffer))
        for group, p, q in zip(self.groups, ps, qs):
            first = 0
            for run in group.runs:
                write_product(next(views), p[first : first + run.count], q[first : first + run.count])
                first += run.count

    def write_plain(self, buffer: torch.Tensor, averaged: torch.Tensor) -> None:
        """The uncompressed elements' average (this layout's order) back to their places in the bucket."""
        if not self.plain_runs:
            return
        plain = self._bucket_views(buffer)[len(self.runs) - len(self.plain_runs) :]
        torch._foreach_copy_(plain, [run.in_memory(averaged, base=self.plain_start) for run in self.plain_runs])


def plan(bucket: GradBucket, rank: int, min_compression_rate: float) -> MatrixGroups:
    """Which gradients of ``bucket`` to compress (``n x m`` with ``n m >= rate r (n + m)``), grouped by shape."""
    shapes: list[tuple[int, int, int] | None] = []
    numels = []
    for grad in bucket.gradients():
        shape = matrix_shape(grad)
        chosen = None
        if shape is not None:
            rows, cols = shape
            r = min(rank, rows, cols)
            if rows * cols >= min_compression_rate * r * (rows + cols):
                chosen = (rows, cols, r)
        shapes.append(chosen)
        numels.append(grad.numel())
    return MatrixGroups(shapes, numels)
