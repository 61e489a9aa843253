"""What ``DiLoCo`` checks when it is built: the model, the inner optimizer, the knobs.

gradsync's other capabilities sit beside this package (import-linter forbids importing them), so
they are recognised by the module their class comes from.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..wrapper.data_parallel import DataParallelWrapper


def _from(obj: object, package: str) -> bool:
    return type(obj).__module__.startswith(package)


def check_model(model: Any) -> None:
    rank = dist.get_rank()
    if _from(model, "gradsync.elastic"):
        raise NotImplementedError(
            f"DiLoCo over gradsync.elastic's fault-tolerant wrapper is not supported yet (rank {rank}): pass the "
            "plain module or a gradsync DistributedDataParallel."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"DiLoCo's model must be an nn.Module or a gradsync DistributedDataParallel, got {type(model).__name__}."
        )
    if isinstance(model, nn.parallel.DistributedDataParallel) and not isinstance(model, DataParallelWrapper):
        raise TypeError(
            f"DiLoCo's model is torch's DistributedDataParallel (rank {rank}); an island must be a "
            "gradsync.DistributedDataParallel (or pass the plain module: each process is then a replica)."
        )
    bad = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        raise TypeError(f"DiLoCo averages floating-point parameters only; {bad} are not (rank {rank}).")
    if not bad and not list(model.parameters()):
        raise ValueError(f"DiLoCo's model has no parameters (rank {rank}).")


def check_inner_optimizer(model: nn.Module, inner: Any, island_known: bool = False) -> None:
    """``island_known``: the caller holds the island's DDP and passes its module (gradsync.elastic_diloco)."""
    rank = dist.get_rank()
    if _from(inner, "gradsync.zero") and not isinstance(model, DataParallelWrapper) and not island_known:
        raise ValueError(
            f"DiLoCo with gradsync.zero's ShardedOptimizer as the inner optimizer needs the island's gradsync "
            f"DistributedDataParallel as its model (rank {rank}): the optimizer shards over that DDP's group. Pass "
            "the DDP the ShardedOptimizer was built over, not its module."
        )
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}.")
    ours = {id(p) for p in model.parameters()}
    stray = sum(1 for g in inner.param_groups for p in g["params"] if id(p) not in ours)
    if stray:
        raise ValueError(
            f"inner_optimizer steps {stray} tensors that are not parameters of DiLoCo's model (rank {rank}); "
            "build it over model.parameters()."
        )


MERGES = ("mix", "keep_inner_steps")


def check_knobs(alpha: float, merge: str, outer_optimizer: Callable[..., Any] | None) -> None:
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (theta <- alpha * local + (1 - alpha) * global), got {alpha!r}.")
    if merge not in MERGES:
        raise ValueError(
            f"merge must be one of {MERGES} (how a fragment that lands after `delay` inner steps is merged into "
            f"the local parameters; docs/diloco.md), got {merge!r}."
        )
    if merge == "keep_inner_steps" and float(alpha) != 0.5:
        raise ValueError(
            f"alpha={alpha!r} is not used by merge='keep_inner_steps' (it adds the inner steps taken during the "
            "exchange to the new theta_global); pass one of them."
        )
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise TypeError(
            "outer_optimizer must be a callable that takes the outer parameters and returns a torch.optim "
            f"optimizer, e.g. functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True); got "
            f"{type(outer_optimizer).__name__}."
        )


def check_error_feedback(error_feedback: bool, wire: object) -> None:
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be True or False, got {type(error_feedback).__name__}.")
    if error_feedback and wire == "fp32":
        raise ValueError(
            "error_feedback=True keeps what a lossy wire's rounding removed and sends it with the next exchange; "
            "wire='fp32' rounds nothing. Use it with wire='bf16', 'int8' or 'int4', or leave it False."
        )


def check_outer_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"outer_optimizer(params) must return a torch.optim.Optimizer, got {type(optimizer).__name__}.")


def check_replicas_agree(settings: dict[str, Any], groups: list[dist.ProcessGroup]) -> None:
    """Every process built DiLoCo the same way: a different schedule or layout would pair collectives
    that do not belong together (a hang, or a silently wrong average). All ranks see the same gathered
    list, so all of them raise together."""
    for group in groups:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, settings, group=group)
        ranks = dist.get_process_group_ranks(group)
        differ = {
            ranks[i]: {k: other.get(k) for k in settings if other.get(k) != everyone[0].get(k)}
            for i, other in enumerate(everyone)
            if other != everyone[0]
        }
        if differ:
            keys = sorted({k for values in differ.values() for k in values})
            ours = {k: everyone[0].get(k) for k in keys}
            raise ValueError(
                f"DiLoCo must be built the same way on every process it exchanges with; ranks {sorted(differ)} differ "
                f"from rank {ranks[0]} in {keys} (seen on rank {dist.get_rank()}): rank {ranks[0]} has {ours}, "
                f"{'; '.join(f'rank {r} has {v}' for r, v in differ.items())}. Pass the same sync_every, fragments, "
                "delay, alpha, wire and model everywhere."
            )


def fragment_count(fragments: object) -> int:
    """How many fragments: an int as given (the schedule checks it), or the length of a list of submodules."""
    if isinstance(fragments, (list, tuple, nn.ModuleList)):
        return len(fragments)
    if isinstance(fragments, nn.Module):
        raise TypeError(
            f"fragments is one {type(fragments).__name__} (rank {dist.get_rank()}): pass a list of submodules, one "
            "per fragment (fragments=[block_a, block_b]), or an int for strided fragments."
        )
    return fragments  # type: ignore[return-value]  # Schedule.checked raises for anything but an int
