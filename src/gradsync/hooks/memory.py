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

from typing import Any

import torch

from ..engine.grad_bucket import GradBucket
from .allreduce import allreduce_future, end_bucket


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

    def put(self, index: int, params: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Store ``tensor`` for bucket ``index`` holding ``params`` (a healed state's memory)."""
        self._entries[index] = (tuple(id(p) for p in params), tensor)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def start_with_error_feedback(
    state: Any, bucket: GradBucket
) -> tuple[torch.futures.Future[torch.Tensor] | None, torch.Tensor, torch.Tensor | None]:
    """The common start of hooks with error feedback (``state.errors``, ``.error_feedback``).

    A sparse bucket is all-reduced unchanged: returns its future. Otherwise the held-back
    error of this bucket (if any) is added to its buffer; returns ``(None, buffer, error)``.
    """
    buffer = bucket.buffer()
    if buffer.is_sparse:
        future = allreduce_future(buffer, state.process_group, state.world_size, state.wire)
        end_bucket(state.wire, bucket)
        return future, buffer, None
    error = state.errors.lookup(bucket) if state.error_feedback else None
    if error is not None:
        buffer.add_(error)
    return None, buffer, error
