"""One synced backward's progress: which parameters are ready, which buckets were launched, what went wrong.

The reducer starts a new ``BackwardPass`` whenever a synced forward arms it (and again for a
second backward through a retained graph); nothing of a pass survives into the next one.
"""

from __future__ import annotations

from typing import Any

from ..observability.timing import IterationTimes
from .bucket_set import BucketSet


class BackwardPass:
    __slots__ = ("ready", "pending", "next_bucket", "launched", "errors", "marked_unused", "known_unused", "times")

    def __init__(self, num_params: int, buckets: BucketSet) -> None:
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
