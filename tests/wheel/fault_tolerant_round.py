"""One replica of a fault-tolerant run of two, from an installed gradsync (make wheel-check).

    python -m gradsync.elastic.store --port 29400 &
    GRADSYNC_STORE=127.0.0.1:29400 GRADSYNC_REPLICAS=2 GRADSYNC_RUN_ID=r python tests/wheel/fault_tolerant_round.py ddp

``ddp``: ``elastic.FaultTolerant`` over gradsync's DDP commits three steps; ``diloco``:
``FaultTolerantDiLoCo`` commits two outer steps. Nobody dies here (tests/test_elastic.py and
tests/test_diloco_elastic.py kill replicas): this checks that the installed package runs the mode.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.elastic_diloco import FaultTolerantDiLoCo

STEPS = 4


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def fault_tolerant_ddp() -> str:
    ddp = DDP(make_model())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ft = elastic.FaultTolerant(ddp, optimizer)
    committed = 0
    while ft.step_count < STEPS:
        optimizer.zero_grad()
        x, y = batch(ft.rank, ft.step_count)
        nn.functional.cross_entropy(ddp(x), y).backward()
        committed += ft.step()
    assert committed == STEPS and ft.world_size == 2, (committed, ft.world_size)
    dist.barrier()  # nobody leaves while another still trains
    ft.close()
    return f"{committed} steps committed by both replicas"


def fault_tolerant_diloco() -> str:
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = FaultTolerantDiLoCo(model, inner, sync_every=2)
    while outer.step_count < STEPS:
        x, y = batch(outer.rank, outer.step_count)
        nn.functional.cross_entropy(model(x), y).backward()
        outer.step()
        inner.zero_grad()
    assert outer.outer_steps == STEPS // 2 and len(outer.contributors) == 2, (outer.outer_steps, outer.contributors)
    assert outer.replicas_identical(), "theta_global differs between the replicas"
    dist.barrier()
    outer.close()
    return f"{STEPS // 2} outer steps, both replicas contributing"


def main() -> None:
    mode = sys.argv[1]
    run = elastic.init(timeout_s=30.0, heartbeat_timeout_s=5.0, join_timeout_s=60.0)
    said = {"ddp": fault_tolerant_ddp, "diloco": fault_tolerant_diloco}[mode]()
    print(f"{mode} replica {run.uuid[:8]}: {said}", flush=True)


if __name__ == "__main__":
    main()
