"""Run under torchrun inside a shaped namespace (tests/test_link.py): which bucket caps does
gradsync's default pick for a 16 MiB model, and does it train to identical replicas?"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from link_replicas import identical  # this folder is the script's: on sys.path
from torch import nn

from gradsync import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 16 MiB of gradients
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        optimizer.zero_grad()
        ddp(torch.randn(8, 1024, generator=generator)).square().mean().backward()
        optimizer.step()
    same = identical(model)
    if dist.get_rank() == 0:
        result = {"caps": ddp.engine.layout.caps, "identical": same}
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
