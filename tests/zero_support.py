"""What the ZeRO tests share: two param groups the shards straddle, and how replicas are compared."""

from __future__ import annotations

import copy

import torch
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer

from models import all_gather_flat, global_batch, loss_fn, make_model, rank_world, shard


def two_groups(model: nn.Module, lr: float) -> list[dict]:
    """Two param groups with different lr and weight decay: the shards straddle them."""
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return [{"params": rest}, {"params": head, "lr": lr / 2, "weight_decay": 0.0}]


def max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


def identical_across_ranks(model: nn.Module) -> bool:
    replicas = all_gather_flat(list(model.parameters()))
    return all(torch.equal(replicas[0], r) for r in replicas)


def sharded_and_reference(
    name: str,
    stage: int,
    optimizer: type,
    kwargs: dict,
    caps: float | None = None,
    ddp_options: dict | None = None,
    **options: object,
):
    """Two DDPs of model ``name`` (built with ``ddp_options``) from the same weights: one with a
    ShardedOptimizer (``options`` passed to it), one with the plain torch ``optimizer``; both over
    two param groups."""
    ddp_kwargs = {**(ddp_options or {}), **({} if caps is None else {"bucket_cap_mb": caps})}
    torch.manual_seed(0)
    model = make_model(name)
    reference_model = copy.deepcopy(model)
    ddp = DDP(model, **ddp_kwargs)
    reference = DDP(reference_model, **ddp_kwargs)
    sharded = ShardedOptimizer(ddp, optimizer, two_groups(model, kwargs["lr"]), stage=stage, **options, **kwargs)
    plain = optimizer(two_groups(reference_model, kwargs["lr"]), **kwargs)
    return ddp, sharded, reference, plain


def train(ddp: DDP, optimizer: torch.optim.Optimizer, name: str, steps: int, micro: int = 1, **kw: object) -> None:
    rank, world = rank_world()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(steps):
        optimizer.zero_grad()
        for m in range(micro):
            x, y = global_batch(name, world, 10 * step + m)
            if m < micro - 1:
                with ddp.no_sync():
                    loss_fn(ddp(shard(x, rank, world), **kw), shard(y, rank, world)).backward()
            else:
                loss_fn(ddp(shard(x, rank, world), **kw), shard(y, rank, world)).backward()
        optimizer.step()
        scheduler.step()
