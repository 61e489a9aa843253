"""A training script written for torch's DDP that never imports gradsync (make wheel-check).

It prints which class ``torch.nn.parallel.DistributedDataParallel`` built: torch's own, or
gradsync's where ``GRADSYNC_INSTALL=1`` (the .pth file of the wheel) or ``python -m gradsync.run``
installed it. Under torchrun it trains with every rank; run directly, in a world of one process.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if "RANK" in os.environ:
            dist.init_process_group("gloo")  # torchrun's rank, world size and address
        else:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            optimizer.zero_grad()
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
        dist.all_gather(every, weights)
        assert all(torch.equal(w, weights) for w in every), "the replicas' weights differ after 3 steps"
        cls = type(model)
        print(f"rank {dist.get_rank()}: DDP is {cls.__module__}.{cls.__qualname__}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
