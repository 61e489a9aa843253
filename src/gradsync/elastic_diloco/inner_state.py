"""The inner optimizer's state as fault-tolerant DiLoCo heals it: whole from one process, or shard by shard.

A plain inner optimizer holds the same state on every member of an island (the island's DDP gives
them the same gradients), so one process's ``state_dict`` heals a whole island. A
``gradsync.zero.ShardedOptimizer`` holds on each member only the ranges it owns: a restarted island's
members then take theirs from the members of a live island that own them ([Note: shards healed across
islands] in zero/shard_copy.py), and its shards follow the island's DDP to each generation's group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..elastic import heal, membership
from ..zero.shard_copy import copy_shards
from ..zero.sharded_optimizer import ShardedOptimizer


class InnerState:
    """One process's inner optimizer, as the heals of a fault-tolerant DiLoCo run move its state."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.sharded = optimizer if isinstance(optimizer, ShardedOptimizer) else None

    def regrouped(self) -> None:
        """The island's DDP was rebuilt over a new group: a sharded optimizer's shards follow it."""
        if self.sharded is not None:
            self.sharded.follow_regrouped_engine()

    def whole(self) -> dict[str, Any] | None:
        """What a heal source sends to every process (None when sharded: the shards travel in ``copy``)."""
        return None if self.sharded is not None else self.optimizer.state_dict()

    def finite(self) -> bool:
        """Whether every floating tensor of this process's state is finite (its shards' when sharded)."""
        if self.sharded is not None:
            values = (v for piece in self.sharded.shard_state().values() for v in piece.values())
        else:
            values = (v for state in self.optimizer.state.values() for v in state.values())
        return all(bool(torch.isfinite(t).all()) for t in values if torch.is_tensor(t) and t.is_floating_point())

    def copy(self, islands: list[list[int]], source: int, targets: list[int], device: torch.device) -> None:
        """The islands ``targets`` take island ``source``'s state (indices into ``islands``, each island's global
        ranks): collective over the generation's group, every process calling with the same arguments."""
        if not targets:
            return
        me = dist.get_rank()
        if self.sharded is None:
            sender = islands[source][0]
            payload = self.optimizer.state_dict() if me == sender else None
            state = heal.transfer(payload, sender, membership.world(), device)
            if any(me in islands[t] for t in targets):
                self.optimizer.load_state_dict(state)
            return
        for t in targets:  # in the same order everywhere: each pair makes a group of its two islands
            if me in islands[source] or me in islands[t]:
                copy_shards(self.sharded, islands[source], islands[t], device)
