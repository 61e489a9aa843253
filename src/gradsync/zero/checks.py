"""What a ``ShardedOptimizer`` checks: when it is built, the wrapper, the optimizer, the param groups;
before its collective ``state_dict``, that every rank called it."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..engine.reduce_scatter import ReduceScatter
from ..engine.reductions import AllReduce, CommHookReduction
from ..hooks.shardable import shard_wire_dtype
from ..wrapper.data_parallel import DataParallelWrapper
from .elementwise import check_elementwise


def check_usable(ddp: Any, optimizer_class: type, stage: int, elementwise: bool | None, step_in_backward: bool) -> None:
    if not isinstance(ddp, DataParallelWrapper):
        raise TypeError(f"ShardedOptimizer shards over a gradsync.DistributedDataParallel, got {type(ddp).__name__}.")
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (gradients too), got {stage!r}.")
    if step_in_backward and stage != 2:
        raise ValueError(
            f"step_in_backward=True needs stage=2 (rank {ddp.engine.rank}): stage 1 keeps the full averaged .grad "
            "for code that reads it after backward, which a step inside backward would already have used."
        )
    check_elementwise(optimizer_class, elementwise)
    engine = ddp.engine
    if engine.iteration > 0 or engine.synced_forwards > 0:
        raise RuntimeError(
            f"ShardedOptimizer must be built before the first forward of its DistributedDataParallel (rank "
            f"{engine.rank} is at iteration {engine.iteration}): it lays the shards over the buckets."
        )
    if isinstance(engine.reduction, ReduceScatter):
        raise RuntimeError(
            f"This DistributedDataParallel already has a ShardedOptimizer (rank {engine.rank}); one per wrapper. "
            "Pass every parameter group to that one."
        )
    if isinstance(engine.reduction, CommHookReduction):  # a cast hook becomes the shards' wire dtype
        shard_wire_dtype(engine.reduction.hook, engine.reduction.name or "", engine.rank)
    unsupported = []
    if not isinstance(engine.reduction, (AllReduce, CommHookReduction)):
        unsupported.append("another reduction")
    if engine.fused_optimizer is not None:
        unsupported.append("_register_fused_optim")
    if unsupported:
        raise NotImplementedError(
            f"ShardedOptimizer does not support {', '.join(unsupported)} yet (rank {engine.rank}); use plain DDP "
            "with an unsharded optimizer for this configuration."
        )


def param_groups_over(ddp: DataParallelWrapper, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """torch's param-group dicts over ``ddp``'s reduced parameters (all of them by default)."""
    reduced = {id(p) for p in ddp.engine.params}
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    if params is None:
        return [{"params": list(ddp.engine.params)}]
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    for group in groups:
        members = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        outside = [names.get(id(p), f"a {tuple(p.shape)} tensor") for p in members if id(p) not in reduced]
        if outside:
            raise ValueError(
                f"ShardedOptimizer can only step parameters its DistributedDataParallel reduces; {outside} are not "
                "among them (frozen, ignored, or of another module). Pass ddp.parameters() that require grad."
            )
        group["params"] = members
    return groups


def check_every_rank_calls(helper: dist.ProcessGroup, timeout: timedelta, rank: int) -> None:
    """``state_dict`` is collective: a rank calling it alone gets this error within ``timeout``, not a hang."""
    try:
        dist.monitored_barrier(helper, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"ShardedOptimizer.state_dict() is collective: every rank must call it, but not every rank did "
            f"within {timeout.total_seconds():.0f}s (seen on rank {rank}): {error}. Call it on "
            "every rank and save from rank 0."
        ) from error
