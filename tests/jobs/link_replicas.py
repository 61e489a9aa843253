"""Run under torchrun inside a shaped namespace, or by link.run_ranks behind per-rank links
(tests/test_link.py): every benchmark contender
that communicates trains a few steps on per-rank data; are the replicas identical?

Writes JSON to --out: {contender: replicas_identical} and the bytes tc's shaper saw.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the benchmarks package

from benchmarks.lib import contenders, link  # noqa: E402
from benchmarks.lib.common import train_step  # noqa: E402
from benchmarks.lib.workloads import WORKLOADS  # noqa: E402

# no_comm trains each rank alone on purpose: its replicas are meant to differ.
COMMUNICATING = [name for name in contenders.CONTENDERS if name != "no_comm"]


def identical(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    workload = WORKLOADS["cnn_bn"]  # small, with buffers: the broadcast before forward is exercised too
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [workload.make_batch(generator) for _ in range(2)]
    torch.manual_seed(0)
    base = workload.build()
    result = {}
    for name in COMMUNICATING:
        model, after = contenders.build(name, copy.deepcopy(base), cap=1.0)
        optimizer = contenders.optimizer(name, model, lr=1e-3, momentum=0.9)
        step = train_step(model, optimizer, workload.loss, batches, after)
        for i in range(3):
            step(i)
        result[name] = identical(model)
    if dist.get_rank() == 0:
        device = link.shaped_device()  # lo, or eth0 behind a per-rank link
        shaper = subprocess.run(["tc", "-s", "qdisc", "show", "dev", device], capture_output=True, text=True).stdout
        result["_shaper"] = shaper
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
