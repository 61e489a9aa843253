"""Which parameters a backward uses: the graph search's answer, what autograd reported, what all ranks agreed.

[Note: unused parameters]
With ``find_unused_parameters=True`` the reducer searches the autograd graph behind each synced
forward's outputs; parameters it cannot reach are marked ready at the start of backward (their
buckets need not wait for them). Whatever the setting, a parameter's hook records that it got a
gradient since the last synced backward, and with ``find_unused_parameters`` (or in the first
static-graph iteration) the ranks all-reduce that map at the end of backward: a parameter no rank
used keeps its ``.grad`` as it was, as with torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..observability.desync import DesyncDetector
from . import graph
from .agreement import agree_on_used, shadow_used_map


class ParameterUsage:
    def __init__(self, count: int, find_unused_parameters: bool, static_graph: bool) -> None:
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.used_since_sync = [False] * count  # set by every parameter's hook (the hot path)
        self.forward_unused: set[int] | None = None  # the graph search's answer for the armed forward
        self.never_used: list[bool] | None = None  # static_graph: whether any rank used it in iteration 0

    def search(self, roots: list[torch.autograd.graph.Node], params: Sequence[torch.Tensor], combine: bool) -> None:
        """The parameters the graph behind ``roots`` does not reach. With no roots nothing tells
        which parameters the coming backward uses; those that report nothing then count as unused
        at its end."""
        if not roots:
            self.forward_unused = None
            return
        reached = graph.reachable_leaves(roots)
        unused = {i for i, p in enumerate(params) if id(p) not in reached}
        # Several forwards before one backward: a parameter used by any of them is used.
        if combine and self.forward_unused is not None:
            unused &= self.forward_unused
        self.forward_unused = unused

    def must_agree(self, iteration: int) -> bool:
        """Whether the ranks all-reduce the used map at the end of this synced backward. The same on
        every rank: it depends on the synced iteration count, which joined ranks advance too."""
        return self.find_unused_parameters or (self.static_graph and iteration == 0)

    def agree(
        self, group: dist.ProcessGroup, device: torch.device, desync: DesyncDetector | None, forwards: int
    ) -> list[bool]:
        """Used on any rank since the last synced backward (one all-reduce of the map)."""
        return agree_on_used(self.used_since_sync, group, device, desync, forwards)

    def shadow_agree(self, iteration: int, group: dist.ProcessGroup, device: torch.device) -> list[bool] | None:
        """A joined rank's part of the end of a synced backward: the others' used map when they agree on one."""
        if not self.must_agree(iteration):
            return self.never_used
        work, flags = shadow_used_map(len(self.used_since_sync), group, device)
        work.wait()
        return [bool(u) for u in flags.tolist()]

    def learn_never_used(self, globally_used: list[bool] | None) -> list[int]:
        """static_graph's first backward: parameters no rank used keep ``.grad`` None from now on; their indices."""
        never = [i for i, used in enumerate(globally_used or []) if not used]
        if never:
            self.never_used = list(globally_used)  # type: ignore[arg-type]  # not None: ``never`` came from it
        return never

    def end_synced_backward(self) -> None:
        self.used_since_sync = [False] * len(self.used_since_sync)
