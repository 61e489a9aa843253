"""A sharded optimizer's state copied from one island's members to another's, shard by shard.

[Note: shards healed across islands]
Fault-tolerant DiLoCo heals a restarted island from a live one (gradsync.elastic_diloco). With a
``ShardedOptimizer`` inside the islands no process holds the whole inner optimizer state, and the
point of sharding is that none has to: each member of the restarted island receives the state of
the ranges *it* owns, from the members of the live island that own them. The two islands may be
of different sizes and their buckets laid out differently (a restarted island's DDP has not rebuilt
its buckets yet): the ranges are matched element by element, as a bucket rebuild matches them
([Note: state per piece] in state_exchange.py), over a group of the two islands' processes, so each
process holds at most its own shard's worth at a time plus one key in flight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..collectives.groups import group_of_members
from ..engine.sharding import Piece
from .sharded_optimizer import ShardedOptimizer
from .state_exchange import exchange_pieces


def copy_shards(optimizer: ShardedOptimizer, source: list[int], target: list[int], device: torch.device) -> None:
    """The members of ``target`` (global ranks of one island) take the state of the ranges they own from the
    members of ``source`` (another island's, live): collective over the processes of both islands only."""
    me = dist.get_rank()
    assert me in source or me in target, "copy_shards called by a process of neither island"
    ranks = sorted(source + target)  # a group's ranks are its members' in global order
    group = group_of_members(ranks, backend="gloo")  # the state travels on the host's group, as healing does
    mine = [optimizer.shard_layout.pieces(r) for r in range(len(source if me in source else target))]
    senders = _layout_of(mine if me == source[0] else None, source[0], group)
    receivers = _layout_of(mine if me == target[0] else None, target[0], group)
    old = [senders[source.index(g)] if g in source else [] for g in ranks]
    new = [receivers[target.index(g)] if g in target else [] for g in ranks]
    # exchange consumes what it is given: a copy of the dicts, the tensors themselves are only read
    state = {piece: dict(values) for piece, values in optimizer.shard_state().items()} if me in source else {}
    received = exchange_pieces(state, old, new, group, device)
    if me in target:
        optimizer.load_shard_state(received)


def _layout_of(pieces: list[list[Piece]] | None, owner: int, group: dist.ProcessGroup) -> list[list[Piece]]:
    """The pieces every member of ``owner``'s island owns, as ``owner`` knows them."""
    box: list[Any] = [pieces]
    dist.broadcast_object_list(box, src=owner, group=group)
    return list(box[0])
