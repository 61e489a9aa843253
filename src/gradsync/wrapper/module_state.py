"""What a wrapper broadcasts of its module: parameters and buffers at construction and after join,
buffers before each synced forward.

The source is rank 0, or under join the largest rank still training (the caller picks it). The
buffer broadcast before a forward is checked by the desync detector like every collective, and in
the fault-tolerant mode a failure is noted for the step instead of raised
([Note: a step is decided before it is written] in engine/tolerance.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..collectives.broadcast import StandingBroadcast, broadcast_coalesced
from ..engine.reducer import Reducer
from ..observability.desync import Position
from ..observability.labels import label
from . import synced


class ModuleState:
    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        self.params = params  # the reduced parameters, in the engine's order
        self.buffers = buffers  # synchronised buffers (not ignored)
        # Before every synced forward: [Note: a broadcast that keeps its flat buffers] in collectives/broadcast.py
        self._buffer_broadcast = StandingBroadcast(buffers)

    def broadcast(self, src: int, group: dist.ProcessGroup, include_buffers: bool) -> None:
        """Every rank gets ``src``'s parameters (and buffers), bit for bit."""
        state = [p.detach() for p in self.params]
        if include_buffers:
            state += self.buffers
        broadcast_coalesced(state, src, group)

    def sync_buffers(self, engine: Reducer, group: dist.ProcessGroup, source: Callable[[], int]) -> None:
        """Before a forward: every rank gets the buffers of the rank ``source()`` names."""
        with label("gradsync::sync_buffers"):
            if engine.desync is not None:
                numel = sum(b.numel() for b in self.buffers)
                engine.desync.check(Position("buffer broadcast", engine.synced_forwards + 1, numel, "mixed"))
            src = source()
            engine.phase = "the buffer broadcast before forward"
            if engine.tolerance.failures:
                return  # fault-tolerant mode: this step failed already
            try:
                # A buffer saved for backward (e.g. by an eval-mode BatchNorm) is overwritten
                # with equal values on the source rank; keep autograd's version check quiet.
                with synced.preserve_version_counters(self.buffers):
                    self._buffer_broadcast(src, group)
            except RuntimeError as error:
                if engine.tolerance.note(f"the buffer broadcast failed: {error}"):
                    return
                raise RuntimeError(engine.collective_failure_message(str(error))) from error
