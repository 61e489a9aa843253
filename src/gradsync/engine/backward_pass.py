"""One synced backward's progress: which parameters are ready, which buckets were launched, what went wrong.

The reducer starts a new ``BackwardPass`` whenever a synced forward arms it (and again for a
second backward through a retained graph); nothing of a pass survives into the next one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..observability.timing import IterationTimes, now
from .bucket_set import BucketSet


class BackwardPass:
    __slots__ = (
        "bucket_of",
        "ready",
        "pending",
        "next_bucket",
        "launched",
        "errors",
        "marked_unused",
        "known_unused",
        "times",
    )

    def __init__(self, num_params: int, buckets: BucketSet) -> None:
        self.bucket_of = buckets.bucket_of
        self.ready = [False] * num_params  # per parameter: its gradient is final for this backward
        self.pending = [len(s.params) for s in buckets.storages]  # per bucket: parameters not yet ready
        self.next_bucket = 0  # the next bucket to launch ([Note: launch order] in reducer.py)
        # Per launched bucket, in order: a work handle, a comm hook's future, or None (skipped, or
        # its start failed). Finalize waits for them.
        self.launched: list[Any] = []
        # Problems to raise at the end of backward: messages, or a comm hook's own exception.
        self.errors: list[str | Exception] = []
        self.marked_unused: set[int] = set()  # marked ready without a gradient in this backward
        self.known_unused: set[int] = set()  # known unused when backward began (skip_all_reduce_unused_params)
        self.times = IterationTimes(len(buckets.storages))

    def mark_ready(self, index: int) -> bool:
        """Parameter ``index``'s gradient is final. True when that made its bucket complete *and* the
        next one to launch: the caller then launches ``launchable()``. Runs once per parameter."""
        self.ready[index] = True
        bucket = self.bucket_of[index]
        pending = self.pending
        pending[bucket] -= 1
        if pending[bucket]:
            return False
        self.times.bucket_ready[bucket] = now()
        return bucket == self.next_bucket

    def launchable(self) -> Iterator[int]:
        """The complete buckets whose turn it is, in index order; each counts as launched once the
        caller has started it ([Note: launch order] in reducer.py)."""
        pending = self.pending
        while self.next_bucket < len(pending) and pending[self.next_bucket] == 0:
            yield self.next_bucket
            self.next_bucket += 1
