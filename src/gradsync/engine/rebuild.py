"""The one-time bucket rebuild: buckets in the order backward really produces gradients.

[Note: bucket rebuild]
The buckets built at construction follow reverse registration order, a guess at the order
backward makes gradients ready. The first synced backward records the real order; before the
next grad-enabled forward every rank adopts rank 0's record (one broadcast: every rank must
build the same buckets) and the buckets are rebuilt in it, so each one fills, and launches,
as early as backward allows. Parameters that never reported keep their reverse-registration
place at the end. This is only sound when every parameter reports in every iteration, so not
with ``find_unused_parameters`` unless the graph is static; torch makes the same choice.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..observability.desync import DesyncDetector
from .agreement import agree_on_order
from .bucket_set import BucketSet

logger = logging.getLogger("gradsync.reducer")


class BucketRebuild:
    """Records the first synced backward's ready order; rebuilds the buckets in it once."""

    def __init__(self, count: int, enabled: bool) -> None:
        self.count = count
        self.pending = enabled  # still to happen; the reducer's hook records while this is set
        self.done = False
        self.order: list[int] = []  # parameter indices in the order they became ready

    def agreed_order(
        self, group: dist.ProcessGroup, device: torch.device, desync: DesyncDetector | None, forwards: int
    ) -> list[int]:
        """Rank 0's observed order, completed with the parameters that never reported."""
        seen = set(self.order)
        local = self.order + [i for i in reversed(range(self.count)) if i not in seen]
        return agree_on_order(local, group, device, desync, forwards)

    def apply(self, buckets: BucketSet, order: list[int], caps: list[int], as_view: bool, in_place: bool) -> BucketSet:
        """The buckets rebuilt in ``order``; nothing is recorded or rebuilt after this."""
        self.pending = False
        self.done = True
        self.order = []
        return buckets.rebuilt(order, caps, as_view, in_place)


class RebuildsBuckets:
    """Mixed into ``Reducer``: the one-time rebuild, also torch's ``Reducer._rebuild_buckets()``."""

    @property
    def rebuilt(self: Any) -> bool:
        return self._rebuild.done

    def _rebuild_buckets(self: Any) -> bool:
        """Rebuild the buckets once, after the first synced backward; True if this call did.

        [Note: bucket rebuild] in rebuild.py. Also torch's ``Reducer._rebuild_buckets()``, which
        Lightning calls before every manual backward: every call after the rebuild is a no-op.
        """
        if not self._rebuild.pending or self.iteration < 1 or self.reducing:
            return False
        self.phase = "the one-time bucket rebuild broadcast"
        rebuild = self._rebuild
        try:
            order = rebuild.agreed_order(self.process_group, self.buckets.device, self.desync, self.synced_forwards)
        except RuntimeError as error:
            if self.keep_local:  # fault-tolerant mode: the step is decided, and the buckets shipped, later
                self.failures.append(f"the bucket order broadcast failed: {error}")
                return False
            raise RuntimeError(self.collective_failure_message(str(error))) from error
        self._results = []  # the last iteration's work handles still reference the old buffers
        in_place = self.comm_hook is None and not self.keep_local
        self.buckets = rebuild.apply(self.buckets, order, self.caps, self.as_view, in_place)
        self._reset_iteration()
        logger.info("rank %d: rebuilt %d buckets in gradient-ready order", self.rank, len(self.buckets.storages))
        return True
