"""``ReducerLink``: the wrapper's reducer a ``ShardedOptimizer`` reduce-scatters through.

Linking makes the reducer reduce-scatter every bucket into this rank's shard (engine/reduce_scatter.py),
its buckets padded to a multiple of the group's size; a cast hook the reducer had sets what the
gradients are sent in (hooks/shardable.py). The link keeps the buckets it saw laid out, so that the
optimizer notices when the reducer's one-time rebuild replaced them (``relaid_out``), and the reducer
itself, so that it notices when the wrapper got a new one (``check_current``).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist

from ..engine.reduce_scatter import ReduceScatter
from ..engine.reducer import Reducer
from ..engine.reductions import CommHookReduction
from ..engine.sharding import Piece, ShardLayout, memory_order
from ..hooks.shardable import shard_wire_dtype
from ..wrapper.data_parallel import DataParallelWrapper


class ReducerLink:
    """``engine`` reduce-scattering into ``partner``'s shards; ``partner`` steps them (and is told of joins)."""

    def __init__(
        self, engine: Reducer, group: dist.ProcessGroup, stage: int, step_in_backward: bool, partner: Any
    ) -> None:
        rank = dist.get_rank(group)
        self.engine = engine
        # Stepping in backward, backward must not wait for one bucket's reduce-scatter before it launches the
        # next: the link carries the all-gathers too ([Note: buckets released as they drain]).
        in_flight = 2 if step_in_backward else 1
        self.reduction = ReduceScatter(group, keep_full=stage == 1, in_flight=in_flight)
        hooked = engine.reduction
        if isinstance(hooked, CommHookReduction):
            wire_dtype = shard_wire_dtype(hooked.hook, hooked.name, rank)
            self.reduction.compress(hooked.hook, hooked.state, hooked.name, wire_dtype)
        self.reduction.set_join_partner(partner)  # a joined rank steps its shards too (join.py)
        if step_in_backward:
            if engine.tolerance.enabled:
                raise NotImplementedError(
                    f"ShardedOptimizer(step_in_backward=True) cannot run under gradsync.elastic (rank {rank}): "
                    "a step there commits only once every replica voted, after backward. Build it with "
                    "step_in_backward=False."
                )
            # Which parameters were used is agreed at the end of backward when they are tracked.
            at_drain = not (engine.config.find_unused_parameters or engine.config.static_graph)
            self.reduction.listen(partner, at_drain)
        engine.use_reduction(self.reduction, pad_multiple=dist.get_world_size(group))
        self.layout = cast(ShardLayout, self.reduction.layout)  # use_reduction laid the buckets out
        self.buckets = engine.buckets

    def relaid_out(self) -> bool:
        """The reducer's buckets were replaced (its one-time rebuild) since ``take_new_layout`` last took them."""
        return self.engine.buckets is not self.buckets

    def take_new_layout(self) -> tuple[ShardLayout, ShardLayout]:
        """Follow the rebuilt buckets: the layout before and the one the reduction laid them out in now."""
        old = self.layout
        self.layout = cast(ShardLayout, self.reduction.layout)
        self.buckets = self.engine.buckets
        return old, self.layout

    def check_current(self, ddp: DataParallelWrapper) -> None:
        """Raise if ``ddp`` has another reducer than the one linked (it does not reduce-scatter)."""
        if ddp.engine is not self.engine:
            raise RuntimeError(
                "The DistributedDataParallel's reducer was replaced (set_static_graph, a new process group) after "
                "this ShardedOptimizer was built, so the new one does not reduce-scatter. Build the "
                "ShardedOptimizer after those calls."
            )

    def shard_grad(self, piece: Piece) -> torch.Tensor | None:
        """A piece's gradient in the reducer's shards (stage 2, a joined rank); None: not stepped."""
        if not self.reduction.is_used(piece.param, piece.bucket):
            return None
        return self.reduction.grad_shards[piece.bucket].narrow(0, piece.shard_start, piece.length)

    def full_grad(self, piece: Piece) -> torch.Tensor | None:
        """A piece's gradient in ``.grad`` (stage 1)."""
        full = self.engine.params[piece.param].grad
        return None if full is None else memory_order(full).narrow(0, piece.param_start, piece.length)

    @property
    def device(self) -> torch.device:
        return self.engine.buckets.device
