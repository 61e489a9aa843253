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

import torch
import torch.distributed as dist

from ..observability.desync import DesyncDetector
from .agreement import agree_on_order


class BucketRebuild:
    """Records the first synced backward's ready order; rebuilds the buckets in it once."""

    def __init__(self, count: int, enabled: bool) -> None:
        self.count = count
        self.pending = enabled  # still to happen; the reducer's hook records while this is set
        self.done = False
        self.order: list[int] = []  # parameter indices in the order they became ready

    def due(self, iteration: int, reducing: bool) -> bool:
        """After the first synced backward, before the next forward, once."""
        return self.pending and iteration >= 1 and not reducing

    def agreed_order(
        self, group: dist.ProcessGroup, device: torch.device, desync: DesyncDetector | None, forwards: int
    ) -> list[int]:
        """Rank 0's observed order, completed with the parameters that never reported."""
        seen = set(self.order)
        local = self.order + [i for i in reversed(range(self.count)) if i not in seen]
        return agree_on_order(local, group, device, desync, forwards)

    def apply(self) -> None:
        """The buckets are being rebuilt in the agreed order; nothing is recorded or rebuilt after this."""
        self.pending = False
        self.done = True
        self.order = []

    def adopt(self, rebuilt: bool) -> None:
        """Another rank's layout was adopted ([Note: a joiner's buckets] in elastic/heal.py)."""
        self.pending = not rebuilt and self.pending
        self.done = rebuilt
