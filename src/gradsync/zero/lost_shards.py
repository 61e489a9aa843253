"""What a dead rank takes with it under a sharded optimizer: the message the survivors raise.

The fault-tolerant mode (gradsync.elastic) cannot heal a rank's shards: each range is kept once
([Note: a sharded optimizer under the fault-tolerant mode] in elastic/sharded_state.py). This
names, per dead rank, how much died and of which parameters, and how to resume.
"""

from __future__ import annotations

from ..engine.sharding import ShardLayout


def describe(layout: ShardLayout, names: list[str], stage: int, dead_ranks: list[int], world_size: int) -> str:
    lost = []
    for rank in dead_ranks:
        pieces = layout.pieces(rank)
        params = sorted({names[p.param] for p in pieces})
        shown = ", ".join(params[:4]) + (f" and {len(params) - 4} more" if len(params) > 4 else "")
        elements = sum(p.length for p in pieces)
        lost.append(f"rank {rank}'s ({elements} elements of {len(params)} parameters: {shown})")
    what = "optimizer state and this step's averaged gradients" if stage == 2 else "optimizer state"
    return (
        f"The {what} of ShardedOptimizer(stage={stage}) is sharded over {world_size} ranks, each range kept "
        f"once: {'; '.join(lost)} died with the rank and cannot be healed. Restart from the last sharded "
        f"checkpoint with {world_size - len(dead_ranks)} rank(s): build the ShardedOptimizer there and call "
        "gradsync.zero.load_sharded(path, ddp, optimizer) (save with gradsync.zero.save_sharded every few steps)."
    )
