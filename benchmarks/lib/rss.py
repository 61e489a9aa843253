"""Peak resident memory per rank, one contender per process.

[Note: why a process per measurement]
Peak RSS (``ru_maxrss``, the kernel's high-water mark) only ever grows, and freed
memory is not always returned to the kernel, so two contenders measured in one process
would blur into each other. Each (workload, contender) therefore runs in fresh processes,
one per rank: ``python -m benchmarks suite --rss-only CONTENDER --workloads W`` (torchrun), or
started by ``spawn_all`` from inside a running suite (each rank starts its own child; the children
form their own process group on a fresh port).

Importing torch alone leaves a high-water mark above the steady state, higher than a
small model ever needs. So a child, after imports, process-group set-up and the data,
resets the kernel's mark to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux
4.0+) and records that RSS (the *baseline*); then it builds the model and the contender,
runs five iterations and reads the mark again (the *peak*, ``VmHWM``, which is what
``ru_maxrss`` reports). ``peak - baseline`` is what the model, its gradients, the
optimizer state and the contender's buffers cost at their worst moment, one-time costs
(the bucket rebuild at iteration 1) included. Then it resets the mark, runs three more
iterations and reads it once more: ``steady - baseline`` is the cost of training on.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import contenders, launch
from benchmarks.lib.common import free_port, train_step
from benchmarks.lib.workloads import WORKLOADS

MARKER = "RSS_JSON "
ITERATIONS = 5  # includes the DDPs' bucket rebuild at iteration 1
STEADY_ITERATIONS = 3


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> float:
    """Reset the high-water mark to the current RSS; returns that RSS in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mib("VmRSS")


def peak_mib() -> float:
    return _status_mib("VmHWM")


def child_main(contender: str, workload_name: str, cap: Any) -> None:
    """Runs on every rank of a fresh process group; prints one JSON line per rank."""
    workload = WORKLOADS[workload_name]
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [workload.make_batch(generator) for _ in range(4)]
    gc.collect()
    baseline = reset_peak()
    torch.manual_seed(0)
    model, after_backward = contenders.build(contender, workload.build(), cap)
    optimizer = contenders.optimizer(contender, model, lr=1e-3, momentum=workload.momentum)
    step = train_step(model, optimizer, workload.loss, batches, after_backward)
    for i in range(ITERATIONS):
        step(i)
    peak = peak_mib()
    reset_peak()  # from here on: steady state, after one-time costs such as the bucket rebuild
    for i in range(STEADY_ITERATIONS):
        step(i)
    dist.barrier()
    result = {"rank": dist.get_rank(), "baseline_mib": baseline, "peak_mib": peak, "steady_mib": peak_mib()}
    print(MARKER + json.dumps(result), flush=True)


def spawn_all(jobs: list[tuple[str, str, Any]], module: str) -> dict[tuple[str, str], dict[str, float]]:
    """Run each (workload, contender, cap) in fresh child processes of study ``module``; every rank calls this.

    Returns, on every rank, ``{(workload, contender): {"peak_mib", "growth_mib", "steady_mib"}}``
    (``steady_mib`` is a growth too), each the maximum over ranks.
    """
    results = {}
    for workload, contender, cap in jobs:
        port = [free_port() if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        # Not torchrun's agent store: the children's rank 0 hosts their own store.
        env = launch.env({k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")})
        env.update(
            RANK=str(dist.get_rank()),
            LOCAL_RANK=str(dist.get_rank()),
            WORLD_SIZE=str(dist.get_world_size()),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port[0]),
        )
        command = launch.python_m(module, ["--rss-only", contender, "--workloads", workload])
        if cap is not None:
            command += ["--cap", str(cap)]
        mine = _run_child(command, env)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if any(r is None for r in everyone):
            continue
        results[(workload, contender)] = {
            "peak_mib": max(r["peak_mib"] for r in everyone),
            "growth_mib": max(r["peak_mib"] - r["baseline_mib"] for r in everyone),
            "steady_mib": max(r["steady_mib"] - r["baseline_mib"] for r in everyone),
        }
    return results


def _run_child(command: list[str], env: dict[str, str]) -> dict[str, float] | None:
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print(f"rss child timed out: {' '.join(command)}", file=sys.stderr)
        return None
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    print(f"rss child failed ({done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}", file=sys.stderr)
    return None
