"""How many bytes a hook puts on the wire, so compression ratios are measured, not guessed.

[Note: what counts as a byte on the wire]
We count the bytes *this rank sends* under the bandwidth-optimal (ring) algorithms, because
that is what bounds the time of a bandwidth-limited collective and it is what a
compressor is trying to reduce:

* all-reduce of ``n`` bytes over ``W`` ranks sends ``2 (W - 1) / W * n`` bytes per rank
  (a reduce-scatter, then an all-gather, each moving ``(W - 1) / W`` of the tensor);
* all-gather of ``n`` bytes per rank sends ``(W - 1) * n`` bytes per rank (every rank's
  piece has to reach ``W - 1`` others).

The two grow differently with ``W``: an all-reduce's cost per rank is nearly flat, an
all-gather's grows linearly. A hook that all-gathers a compressed payload (top-k, int8)
therefore loses its advantage as the world grows, and these numbers show it.

Sizes are the tensors' logical sizes (``numel * element_size``); transport headers and
the latency of each collective are not counted. With one rank nothing is sent.
"""

from __future__ import annotations

from collections import deque

import torch


def nbytes(tensor: torch.Tensor) -> int:
    """Logical payload size of a dense or sparse (COO) tensor."""
    if tensor.is_sparse:
        return nbytes(tensor._indices()) + nbytes(tensor._values())
    return tensor.numel() * tensor.element_size()


def all_reduce_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``tensor``."""
    return 2 * (world_size - 1) * nbytes(tensor) // world_size


def all_gather_bytes(tensor: torch.Tensor, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather where each rank contributes ``tensor``."""
    return (world_size - 1) * nbytes(tensor)


class WireStats:
    """Bytes sent by this rank, per iteration.

    Hooks call ``add`` for every collective they issue and ``end_iteration`` once the
    last bucket of a backward has been launched (``bucket.is_last()``). Compare two runs'
    ``mean_bytes_per_iteration()`` to get a compression ratio. Only the last ``HISTORY``
    iterations are kept one by one (a run of millions of steps must not grow memory);
    the overall mean comes from running totals.
    """

    HISTORY = 10_000

    __slots__ = ("world_size", "bytes_this_iteration", "_history", "total_bytes", "iterations")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes_this_iteration = 0
        self._history: deque[int] = deque(maxlen=self.HISTORY)
        self.total_bytes = 0
        self.iterations = 0

    @property
    def bytes_per_iteration(self) -> list[int]:
        """Bytes of each of the last (up to ``HISTORY``) finished iterations."""
        return list(self._history)

    def add(self, nbytes: int) -> None:
        self.bytes_this_iteration += nbytes

    def add_all_reduce(self, tensor: torch.Tensor) -> None:
        self.add(all_reduce_bytes(tensor, self.world_size))

    def add_all_gather(self, tensor: torch.Tensor) -> None:
        self.add(all_gather_bytes(tensor, self.world_size))

    def end_iteration(self) -> None:
        self._history.append(self.bytes_this_iteration)
        self.total_bytes += self.bytes_this_iteration
        self.iterations += 1
        self.bytes_this_iteration = 0

    def mean_bytes_per_iteration(self, last: int | None = None) -> float:
        """Mean over all finished iterations (or the ``last`` ones); 0.0 before any."""
        if last is None:
            return self.total_bytes / self.iterations if self.iterations else 0.0
        history = list(self._history)[-last:]
        return sum(history) / len(history) if history else 0.0

    def __repr__(self) -> str:
        return (
            f"WireStats(world_size={self.world_size}, iterations={self.iterations}, "
            f"mean_bytes_per_iteration={self.mean_bytes_per_iteration():.0f})"
        )
