"""``ShardGroups``: the process groups a ``ShardedOptimizer`` works over, and its rank in them.

``group`` is the DDP's: the shards are laid out over its ranks, and the reduce-scatters, the all-gathers
and clipping's norm run on it. ``helper`` (gloo, with ``state_dict``'s timeout) is where ``state_dict``
first checks that every rank called it (checks.py), so that a rank calling it alone gets an error, not a
hang. ``gathers`` exists only when stepping in backward: the all-gathers start there as buckets drain, on a
group of their own beside the reduce-scatters (param_buffers.py). ``join`` is the join state over
``group`` (join.py). The helper groups are made by the DDP's ranks alone ([Note: groups made by their
members] in collectives/groups.py), so they can be made again over each generation's group
(``ShardedOptimizer.follow_regrouped_engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.groups import group_of_members
from .join import ShardedJoin


@dataclass
class ShardGroups:
    group: dist.ProcessGroup
    rank: int  # this rank in ``group``
    helper: Any
    gathers: Any  # None unless stepping in backward
    join: ShardedJoin

    @classmethod
    def over(
        cls, group: dist.ProcessGroup, device: torch.device, step_in_backward: bool, timeout: timedelta
    ) -> ShardGroups:
        ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        helper = group_of_members(ranks, backend="gloo", timeout=timeout)
        gathers = group_of_members(ranks, backend=dist.get_backend(group)) if step_in_backward else None
        return cls(group, dist.get_rank(group), helper, gathers, ShardedJoin(group, device))
