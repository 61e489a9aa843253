"""Why a bucket launch costs more host time inside backward than in a loop: the same call, timed where it runs.

Run from the repository root on a machine with a CUDA GPU (single process, well under a minute):

    python -m benchmarks.studies.gpu_launch_cost [--out DIR]

gpu_host_profile measured 120-240 us of host time per bucket launch (a copy-in and an async
``all_reduce``) on autograd's device thread in the middle of a backward, against 18-27 us for the same
``all_reduce`` in a tight loop on the main thread. This study times one call, with ``perf_counter``
around it only, in each place that differs between the two:

- ``loop, GPU idle``: the main thread, after ``torch.cuda.synchronize()``;
- ``loop, GPU busy``: the main thread, right after queueing ~1000 matmuls (a full launch queue: a
  CUDA call that enqueues may have to wait for room);
- ``loop, other ops between calls``: the main thread, forty small ops of a dozen kinds before each
  timed call (other code through the caches, as a backward runs between two hooks);
- ``other thread, GPU idle``: a Python thread that is not the main one;
- ``hook``: a post-accumulate-grad hook on 14 parameters of benchmarks/studies/gpu_step.py's GPT-2-small
  (where a bucket launch would run) during ``backward()``, at batch 1 (host-bound: the GPU keeps up) and
  batch 8 (GPU-bound: the host runs ahead until the queue is full).

Each place times two calls on a 4 MiB bf16 buffer: ``all_reduce(async_op=True)`` (NCCL, world size 1:
no kernel, but the stream bookkeeping) and ``mul_`` (one kernel launch), so a cost that every CUDA call
pays there is told from one that NCCL's launch pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.studies.gpu_step import GPT, VOCAB, nccl_world_of_one

HOOKED = 14  # as many hooks as the model has buckets under gradsync's defaults
CALLS = 200


def _timed(call: Callable[[], Any], out: list[float]) -> None:
    start = time.perf_counter()
    call()
    out.append(time.perf_counter() - start)


def _calls(buffer: torch.Tensor) -> dict[str, Callable[[], Any]]:
    return {
        "all_reduce(async)": lambda: dist.all_reduce(buffer, async_op=True),
        "mul_ (one kernel)": lambda: buffer.mul_(1.0),
    }


def _other_work(small: torch.Tensor) -> None:
    """Forty small ops of a dozen kinds, as a backward runs between two hooks: other code through the caches."""
    h = small
    for _ in range(4):
        h = torch.nn.functional.layer_norm(h, h.shape[-1:])
        h = torch.softmax(h @ h.T, dim=-1) @ h
        h = torch.nn.functional.gelu(h + 1.0) * 0.5
        h = h.sum(0, keepdim=True).expand_as(h).contiguous() - h.mean()
        h = torch.where(h > 0, h, h * 0.1).clamp(-3, 3)


def _loop(buffer: torch.Tensor, busy: bool, between: bool = False) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    big = torch.randn(2048, 2048, device="cuda")
    small = torch.randn(64, 64, device="cuda")
    for name, call in _calls(buffer).items():
        times[name] = []
        for _ in range(CALLS // 20):
            torch.cuda.synchronize()
            if busy:
                for _ in range(1000):
                    big.mm(big)
            for _ in range(20):
                if between:
                    _other_work(small)
                _timed(call, times[name])
    torch.cuda.synchronize()
    return times


def _other_thread(buffer: torch.Tensor) -> dict[str, list[float]]:
    result: dict[str, list[float]] = {}
    worker = threading.Thread(target=lambda: result.update(_loop(buffer, busy=False)))
    worker.start()
    worker.join()
    return result


def _hooks(model: GPT, buffer: torch.Tensor, batch: int, steps: int) -> dict[str, list[float]]:
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = params[:: max(1, len(params) // HOOKED)][:HOOKED]
    tokens = torch.randint(0, VOCAB, (batch, 1024), device="cuda")
    targets = torch.roll(tokens, -1, dims=1)
    times: dict[str, list[float]] = {}
    for name, call in _calls(buffer).items():
        times[name] = []
        handles = [p.register_post_accumulate_grad_hook(lambda _, c=call, n=name: _timed(c, times[n])) for p in chosen]
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens).view(-1, VOCAB).float(), targets.view(-1))
            loss.backward()
        torch.cuda.synchronize()
        for handle in handles:
            handle.remove()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if not nccl_world_of_one("gpu_launch_cost"):
        return
    torch.manual_seed(0)
    model = GPT().cuda()
    buffer = torch.zeros(2 * 2**20, dtype=torch.bfloat16, device="cuda")
    _hooks(model, buffer, 1, 3)  # warm-up: kernels, the allocator, NCCL's communicator
    _loop(buffer, busy=False)
    places = {
        "loop, GPU idle": _loop(buffer, busy=False),
        "loop, GPU busy": _loop(buffer, busy=True),
        "loop, other ops between calls": _loop(buffer, busy=False, between=True),
        "other thread, GPU idle": _other_thread(buffer),
        "hook in backward, batch 1": _hooks(model, buffer, 1, args.steps),
        "hook in backward, batch 8": _hooks(model, buffer, 8, args.steps),
    }
    summary = {
        place: {name: {"median_us": statistics.median(t) * 1e6, "p90_us": sorted(t)[int(0.9 * len(t))] * 1e6}
                for name, t in times.items()}
        for place, times in places.items()
    }  # fmt: skip
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "us_per_call": summary}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "launch_cost.json").write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
