"""A user's training script, typed, as mypy sees it with gradsync installed (make typecheck, make wheel-check).

It must check with zero errors under ``strict``: every name it uses from gradsync has real types,
not ``Any`` (``assert_type`` fails on ``Any``). ``rejected.py`` beside it holds the calls the checker
must refuse. It also runs, in a world of one process: ``python tests/typing/user_script.py``.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import assert_type

import gradsync
import gradsync.diloco
import gradsync.zero
from gradsync import DDPStats, DistributedDataParallel
from gradsync.hooks import PowerSGDState, powersgd_hook


def train(steps: int) -> DDPStats:
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), bucket_cap_mb=1.0)
    assert_type(model, DistributedDataParallel)
    model.register_comm_hook(PowerSGDState(process_group=None, matrix_approximation_rank=1), powersgd_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        optimizer.zero_grad()
        if step % 2 == 0:
            with model.no_sync():  # accumulate one batch locally
                nn.functional.cross_entropy(model(x), y).backward()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    stats = model.stats()
    assert_type(stats.buckets, tuple[gradsync.BucketInfo, ...])
    return stats


def sharded(steps: int) -> float | None:
    model = DistributedDataParallel(nn.Linear(8, 2))
    optimizer = gradsync.zero.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss: float | None = None
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        loss = optimizer.step()
    return loss


def outer_rounds(steps: int) -> dict[str, object]:
    model = nn.Linear(8, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradsync.diloco.DiLoCo(model, inner, sync_every=2, wire="int8")
    for _ in range(steps):
        inner.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        outer.step()
    state: dict[str, object] = outer.state_dict()
    outer.close()
    return state


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        try:
            stats = train(steps=4)
            sharded(steps=2)
            state = outer_rounds(steps=4)
        finally:
            dist.destroy_process_group()
    print(f"user_script: {stats.iterations} synced iterations, {len(stats.buckets)} bucket(s); DiLoCo: {sorted(state)}")


if __name__ == "__main__":
    main()
