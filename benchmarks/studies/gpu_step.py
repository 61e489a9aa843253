"""GPU step time at world size 1 on NCCL: no DDP, torch's DDP and gradsync on a GPT-2-small-shaped model.

Run from the repository root on a machine with a CUDA GPU (single process, about 2 minutes on an H200):

    python -m benchmarks gpu_step [--batches 8 1] [--rounds 6] [--iters 8] [--out DIR]

which is exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.gpu_step [options]``; on a machine
without CUDA it says so and exits 0. tests/gpu/run_on_device.sh runs it with ``--out $OUT``.

The model: GPT-2 small's shape (12 layers x 768, 12 heads, vocabulary 50257, context 1024, tied
embeddings, 124 M parameters), bf16 autocast, SDPA attention, random tokens, fused AdamW. At world size
1 NCCL's all-reduce is at most a device-to-device copy (the profiler's columns say what ran), so what
separates the contenders is each reducer's own cost: hooks, bucket copies, launches and the end of
backward, in Python for gradsync, in C++ for torch.

Per batch shape (8 x 1024: the GPU is busy; 1 x 1024: the host can become the bottleneck), contenders
``no_ddp``, ``torch_ddp``, ``torch_ddp_view`` (``gradient_as_bucket_view=True``), ``gradsync`` and
``gradsync_view``, built from the same weights, run interleaved in rounds after a warm-up of 10 steps
each (which includes both DDPs' bucket rebuild). Reported per contender:

- **step time** by CUDA events around each step (zero_grad, forward, loss, backward, optimizer step):
  GPU time from the step's first to its last operation, idle gaps included; median, p90, and the
  median of per-round ratios against torch's DDP with a 90% bootstrap interval (lib/common.py's
  ``paired_ratio``). Target (issue #33): gradsync <= 1.02 x torch's DDP at 8 x 1024;
- **host time inside backward()**: ``perf_counter`` around ``loss.backward()``, median;
- **kernels per step**: GPU activities in one profiled step (torch.profiler), and the count and GPU time
  of NCCL's kernels and of device-to-device copies among them;
- **peak memory**: ``max_memory_allocated`` during two steps, above what was allocated before them, and
  the contender's resident bytes (parameters, gradients, buckets, optimizer state).

For gradsync it then sets ``stats()``' communication figures (CUDA events) beside the profiler's NCCL
kernel time and beside what the host clock reports for the same steps (the clock gradsync used before).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from benchmarks.lib import launch
from benchmarks.lib.common import free_port, paired_ratio, processor, report_path, revision, summarise
from gradsync.observability.cuda_clock import CudaClock

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 50257, 1024, 768, 12, 12
WARMUP = 10
CONTENDERS = ("no_ddp", "torch_ddp", "torch_ddp_view", "gradsync", "gradsync_view")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, HEADS, width // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output embedding, as GPT-2


@dataclass
class Contender:
    name: str
    model: nn.Module
    runner: nn.Module  # what forward is called on: the model or its wrapper
    optimizer: torch.optim.Optimizer
    resident_bytes: int = 0
    step_s: list[float] = field(default_factory=list)
    backward_host_s: list[float] = field(default_factory=list)


def build(name: str, base: GPT) -> Contender:
    model = copy.deepcopy(base)
    if name == "no_ddp":
        runner: nn.Module = model
    elif name.startswith("torch_ddp"):
        runner = TorchDDP(model, device_ids=[0], gradient_as_bucket_view=name.endswith("view"))
    else:
        runner = gradsync.DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=name.endswith("view"))
    return Contender(name, model, runner, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))


def step(c: Contender, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One training step; the host seconds spent inside ``backward()``."""
    c.optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = c.runner(tokens)
        loss = F.cross_entropy(logits.view(-1, VOCAB).float(), targets.view(-1))
    start = time.perf_counter()
    loss.backward()
    host = time.perf_counter() - start
    c.optimizer.step()
    return host


def timed_block(c: Contender, data: tuple[torch.Tensor, torch.Tensor], iters: int) -> None:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    hosts = []
    for start, end in events:
        start.record()
        hosts.append(step(c, *data))
        end.record()
    torch.cuda.synchronize()
    c.step_s += [start.elapsed_time(end) / 1e3 for start, end in events]
    c.backward_host_s += hosts


def profile_step(c: Contender, data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """GPU activities of one step, and the GPU time of NCCL's kernels among them."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(c, *data)
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - a profiler without CUPTI: reported, the rest goes on
        return {"error": f"{type(error).__name__}: {error}"}
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [e for e in gpu if "nccl" in e.name.lower()]
    copies = [e for e in gpu if "memcpy dtod" in e.name.lower()]  # what NCCL may do instead at world size 1
    copy_kernels = [e for e in gpu if "copy" in e.name.lower()]  # every copy: gradients into and out of buckets
    return {
        "kernels": len(gpu),
        "nccl_kernels": len(nccl),
        "nccl_gpu_ms": sum(e.time_range.elapsed_us() for e in nccl) / 1e3,
        "memcpy_dtod": len(copies),
        "memcpy_dtod_gpu_ms": sum(e.time_range.elapsed_us() for e in copies) / 1e3,
        "copies": len(copy_kernels),
        "copies_gpu_ms": sum(e.time_range.elapsed_us() for e in copy_kernels) / 1e3,
        **_busy_and_idle(gpu),
    }


def _busy_and_idle(gpu: list[Any]) -> dict[str, Any]:
    """The step's GPU span, the time some activity ran in it, and its longest idle gaps (what ran around them)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in gpu)
    if not spans:
        return {}
    busy, gaps = 0.0, []
    start, end, name = spans[0]
    for s, e, n in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, name[:70], n[:70]))
            start, end = s, e
        elif e > end:
            end = e
        name = n if e >= end else name
    busy += end - start
    gaps.sort(reverse=True)
    return {
        "gpu_span_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0,
        "gpu_busy_ms": busy / 1e3,
        "longest_idle_gaps": [{"ms": g / 1e3, "after": a, "before": b} for g, a, b in gaps[:6]],
    }


def peak_memory(c: Contender, data: tuple[torch.Tensor, torch.Tensor]) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step(c, *data)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def comm_truth(c: Contender, data: tuple[torch.Tensor, torch.Tensor], iters: int) -> dict[str, Any]:
    """gradsync's stats() (CUDA events) against the same figures on the host clock, over ``iters`` steps each."""
    engine = c.runner.engine
    torch.cuda.synchronize()
    events = _stats_over(c, data, iters)
    real_clock = engine.records.clock
    engine.records.clock = CudaClock(engine.buckets.device, capturing=lambda: True)  # every pass untimed: host clock
    try:
        host = _stats_over(c, data, iters)
    finally:
        engine.records.clock = real_clock
    return {"cuda_events": events, "host_clock": host}


def _stats_over(c: Contender, data: tuple[torch.Tensor, torch.Tensor], iters: int) -> dict[str, float]:
    """Averages of stats()' running sums over the next ``iters`` steps only."""
    before = c.runner.stats()
    for _ in range(iters):
        step(c, *data)
    torch.cuda.synchronize()
    after = c.runner.stats()
    n = after.iterations - before.iterations

    def delta(field_name: str) -> float:
        return (getattr(after, field_name) * after.iterations - getattr(before, field_name) * before.iterations) / n

    # Each bucket's mean over the reductions timed in these steps (on CUDA only a sample of them is timed:
    # [Note: sampled bucket completions]), summed over buckets: one step's bucket reduces.
    per_bucket = sum(
        (b.avg_reduce_s * b.timed - p.avg_reduce_s * p.timed) / (b.timed - p.timed)
        for b, p in zip(after.buckets, before.buckets)
        if b.timed > p.timed
    )
    return {
        "iterations": n,
        "backward_ms": delta("avg_backward_s") * 1e3,
        "comm_window_ms": delta("avg_comm_s") * 1e3,
        "exposed_comm_ms": delta("avg_exposed_comm_s") * 1e3,
        "sum_of_bucket_reduce_ms": per_bucket * 1e3,
    }


def run_batch(batch: int, base: GPT, rounds: int, iters: int) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(batch)
    tokens = torch.randint(0, VOCAB, (batch, CONTEXT), device="cuda", generator=generator)
    data = (tokens, torch.roll(tokens, -1, dims=1))
    contenders = []
    for name in CONTENDERS:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        c = build(name, base)
        for _ in range(WARMUP):
            step(c, *data)
        torch.cuda.synchronize()
        c.resident_bytes = torch.cuda.memory_allocated() - before
        contenders.append(c)
    for r in range(rounds):
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            timed_block(c, data, iters)
    reference = next(c for c in contenders if c.name == "torch_ddp")
    rows = {}
    for c in contenders:
        ratio = paired_ratio(c.step_s, reference.step_s, iters)
        summary = summarise(c.step_s)
        rows[c.name] = {
            "step_ms_median": summary.median_ms,
            "step_ms_p90": summary.p90_ms,
            "ratio_to_torch_ddp": ratio,
            "backward_host_ms_median": statistics.median(c.backward_host_s) * 1e3,
            "profile": profile_step(c, data),
            "peak_above_resident_bytes": peak_memory(c, data),
            "resident_bytes": c.resident_bytes,
        }
        if c.name.startswith("gradsync"):
            rows[c.name]["comm_truth"] = comm_truth(c, data, iters)
    for c in contenders:  # free this batch's models before the next
        c.runner = c.model = c.optimizer = None  # type: ignore[assignment]
    torch.cuda.empty_cache()
    return rows


def report(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    gib = 1024**3
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    lines = [
        f"# GPU step: GPT-2-small shape, world size 1 on NCCL ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {revision()}), {os.cpu_count()} CPU cores ({processor()}), {platform.platform()}",
        f"- GPU {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, NCCL {nccl}",
        f"- {args.rounds} rounds x {args.iters} steps per contender after {WARMUP} warm-up steps; bf16 autocast, "
        "fused AdamW",
        "",
    ]
    for batch, rows in results.items():
        lines += [
            f"## Batch {batch} x {CONTEXT}",
            "",
            "| contender | step ms (median) | p90 | / torch DDP [90% CI] | host ms in backward() | kernels/step "
            "| NCCL kernels, GPU ms | DtoD copies, GPU ms | peak above resident GiB | resident GiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in rows.items():
            ratio, low, high = row["ratio_to_torch_ddp"]
            prof = row["profile"]
            lines.append(
                f"| {name} | {row['step_ms_median']:.2f} | {row['step_ms_p90']:.2f} "
                f"| {ratio:.3f} [{low:.3f}, {high:.3f}] "
                f"| {row['backward_host_ms_median']:.2f} | {prof.get('kernels', '-')} | "
                f"{prof.get('nccl_kernels', '-')}, {prof.get('nccl_gpu_ms', float('nan')):.2f} | "
                f"{prof.get('memcpy_dtod', '-')}, {prof.get('memcpy_dtod_gpu_ms', float('nan')):.2f} | "
                f"{row['peak_above_resident_bytes'] / gib:.2f} "
                f"| {row['resident_bytes'] / gib:.2f} |"
            )
        lines += ["", "gradsync's stats() communication figures (ms per step) against the host clock:", ""]
        lines += [
            "| contender | clock | backward | comm window | exposed comm | sum of bucket reduces |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for name, row in rows.items():
            for clock, figures in row.get("comm_truth", {}).items():
                lines.append(
                    f"| {name} | {clock} | {figures['backward_ms']:.2f} | {figures['comm_window_ms']:.2f} | "
                    f"{figures['exposed_comm_ms']:.2f} | {figures['sum_of_bucket_reduce_ms']:.2f} |"
                )
        lines.append("")
    return lines


def nccl_world_of_one(study: str) -> bool:
    """This process as a world of one on NCCL over GPU 0 (the GPU studies' setting); False, saying so, without CUDA."""
    if not torch.cuda.is_available():
        print(f"{study}: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to measure")
        return False
    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="also write results.json and the report here")
    args = parser.parse_args()
    if not nccl_world_of_one("gpu_step"):
        return
    torch.manual_seed(0)
    base = GPT().cuda()
    results = {}
    for batch in args.batches:
        results[batch] = run_batch(batch, base, args.rounds, args.iters)
        print(json.dumps({batch: {k: v["step_ms_median"] for k, v in results[batch].items()}}), flush=True)
    lines = report(results, args)
    path = report_path("gpu-step")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"report: {path}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_step.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / path.name).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
