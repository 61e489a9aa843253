"""Two DiLoCo outer steps over two processes, from an installed gradsync (make wheel-check).

    torchrun --standalone --nproc-per-node 2 tests/wheel/diloco_round.py

Each replica starts from its own seed (DiLoCo broadcasts rank 0's start) and trains on its own
batches; after each outer step every replica holds the same global parameters, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gradsync.diloco

SYNC_EVERY = 2
STEPS = 4


def same_everywhere(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.detach().flatten() for t in tensors])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(theirs, flat) for theirs in every)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradsync.diloco.DiLoCo(model, inner, sync_every=SYNC_EVERY, wire="int8")
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        inner.zero_grad()
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        outer.step()
    assert outer.step_count == STEPS
    assert same_everywhere(outer.global_parameters), "theta_global differs between the replicas"
    assert same_everywhere(list(model.parameters())), "the replicas' parameters differ right after an outer step"
    print(f"rank {rank}: {STEPS // SYNC_EVERY} outer steps, replicas identical", flush=True)
    outer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
