"""One rank of a ZeRO-2 run that ends right after ``optimizer.step()`` (tests/test_zero_overlap.py).

    python tests/jobs/zero_ending.py PORT RANK WORLD MODE

``exit``: returns with the step's all-gathers in flight (the interpreter must let them finish
before it exits). ``destroy``: destroys the process group first, then reads the parameters; the
gathers start only when waited for here (lazy), so they fail, every time, and the read must raise
the error that names the fix. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gradsync.zero.param_buffers as param_buffers
from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer


def main() -> None:
    port, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    if mode == "destroy":
        real = param_buffers.start_all_gather

        class Lazy:
            def __init__(self, *args: object) -> None:
                self.args = args

            def wait(self) -> None:
                real(*self.args).wait()

        param_buffers.start_all_gather = Lazy
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    ddp = DDP(model)
    optimizer = ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        ddp(torch.randn(4, 1024)).square().mean().backward()
        optimizer.step()
    result = {"rank": rank, "in_flight": len(optimizer._params.pending)}
    if mode == "destroy":
        dist.destroy_process_group()
        try:
            model[0].weight.sum().item()
            result["error"] = None
        except RuntimeError as error:
            result["error"] = str(error)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
