"""Tensors a hook keeps for a bucket from one iteration to the next.

Error feedback (what compression left out last time) and PowerSGD's warm-start ``Q``
live here, keyed by ``bucket.index()``.

[Note: memories across a bucket rebuild]
A bucket's index names its position in this iteration's launch order, and the reducer
rebuilds the buckets once, in gradient-ready order, at the start of the second
iteration. After the rebuild index ``b`` may hold different parameters, so a memory
saved under ``b`` would be added to the wrong gradients. Each memory therefore records
which parameters it belongs to; a lookup for a bucket whose parameters changed finds
nothing and the hook starts that bucket afresh (losing one iteration's residual, once).
"""

from __future__ import annotations

import torch

from ..grad_bucket import GradBucket


def _owner(bucket: GradBucket) -> tuple[int, ...]:
    return tuple(id(p) for p in bucket.parameters())


class BucketMemory:
    """One tensor per bucket index, valid while the bucket keeps its parameters."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def lookup(self, bucket: GradBucket) -> torch.Tensor | None:
        """The tensor stored for this bucket, or ``None`` if there is none for its parameters."""
        entry = self._entries.get(bucket.index())
        if entry is None or entry[0] != _owner(bucket):
            return None
        return entry[1]

    def store(self, bucket: GradBucket, tensor: torch.Tensor) -> None:
        self._entries[bucket.index()] = (_owner(bucket), tensor)

    def get(self, index: int) -> torch.Tensor | None:
        """The tensor stored under bucket ``index`` (for inspection and tests)."""
        entry = self._entries.get(index)
        return None if entry is None else entry[1]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
