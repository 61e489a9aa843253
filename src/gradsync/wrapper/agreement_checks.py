"""The wrapper's opt-in checks that its ranks agree: on the replicas' values, and on each collective.

Both are off unless the user switches them on (``enable_divergence_check``,
``enable_desync_detection`` or ``GRADSYNC_DEBUG=desync``): each costs communication of its own.
Once on they stay on for the wrapper's life: a rebuilt engine (``_set_static_graph``,
``_update_process_group``) gets the same desync detector, or a new one over its new group.
- divergence (observability/divergence.py): every ``every`` synced forwards the ranks compare a
  fingerprint of the parameters (and buffers) and raise naming the first one that differs;
- desync (observability/desync.py): before every collective the engine issues, the ranks agree on
  what it is, over a helper group of their own, and raise naming the rank that issued another.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..collectives.groups import group_of_members
from ..observability.desync import DesyncDetector
from ..observability.divergence import DivergenceCheck


class AgreementChecks:
    """The checks switched on for one wrapper, over its process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.divergence: DivergenceCheck | None = None
        self.desync: DesyncDetector | None = None  # handed to every engine the wrapper builds

    def enable_divergence(self, every: int, named: list[tuple[str, torch.Tensor]]) -> None:
        self.divergence = DivergenceCheck(every, named, self.group)

    def enable_desync(self, timeout_s: float) -> None:
        self.desync = self._desync_detector(timeout_s)

    def _desync_detector(self, timeout_s: float) -> DesyncDetector:
        """Its helper group is made by this group's members alone ([Note: groups made by their members]
        in collectives/groups.py), so every member must come here at the same point."""
        ranks = dist.get_process_group_ranks(self.group)
        helper = group_of_members(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        return DesyncDetector(self.group, timeout_s, helper)

    def before_synced_forward(self, synced_forwards: int) -> None:
        """The divergence check's turn, if it is on and ``synced_forwards`` is a multiple of its period."""
        if self.divergence is not None:
            self.divergence.maybe_check(synced_forwards)

    def follow(self, group: dist.ProcessGroup) -> None:
        """The wrapper moved to ``group`` (a rebuilt engine): compare over it from now on. The desync
        detector's helper group is made again over the new members (collective over them)."""
        if group is self.group:
            return
        self.group = group
        if self.divergence is not None:
            self.divergence.group = group
        if self.desync is not None:
            self.desync = self._desync_detector(self.desync.timeout.total_seconds())
