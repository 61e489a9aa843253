"""Where gradsync's host time goes on a GPU: the step at batch 1 x 1024, where the host is the bottleneck.

Run from the repository root on a machine with a CUDA GPU (single process, under a minute on an H200):

    python -m benchmarks.studies.gpu_host_profile [--out DIR]

At batch 1 x 1024 of benchmarks/studies/gpu_step.py's GPT-2-small shape the GPU finishes each step's
kernels before the host has queued the next step's, so the step time is the host's: every microsecond
gradsync spends in Python per parameter or per bucket shows in it. Measured here, interleaved in rounds
(host seconds per step, the GPU synchronised once per block of steps):

- ``no_ddp``; ``no_ddp + empty hooks``: a Python post-accumulate-grad hook that does nothing on every
  parameter, the floor of any design that hears of gradients through Python hooks;
  ``torch_ddp``; ``gradsync``;
- gradsync with parts switched off, to price them: ``gradsync_no_watch`` (no completion event per
  bucket: no ``add_done_callback`` on the work's future), ``gradsync_wait_watch`` (the completion event
  recorded on a side stream after ``work.wait()`` there instead), ``gradsync_untimed`` (no CUDA events
  at all), ``gradsync_no_stream_order`` (no stream noted in hooks, no waits);
- host milliseconds per step inside gradsync's own entry points (gradient hooks, bucket launches and
  their parts; the end of backward; before and after the forward), each charged its own time only;
- a cProfile of gradsync's steps (in Python 3.12 it sees every thread, so autograd's device thread,
  where the hooks run, shows interleaved with the main one: read call counts, not own times), and the
  unit costs of the CUDA calls a hook or a bucket may make.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import launch
from benchmarks.lib.common import paired_ratio, report_path, revision
from benchmarks.lib.overhead import SectionTimer
from benchmarks.studies.gpu_step import GPT, Contender, build, nccl_world_of_one, step, timed_block
from gradsync.engine.streams import StreamOrder
from gradsync.observability.cuda_clock import CudaClock

ROUNDS, BLOCK, WARMUP = 8, 10, 10
VARIANTS = ("gradsync_no_watch", "gradsync_wait_watch", "gradsync_untimed", "gradsync_no_stream_order")


def _with_empty_hooks(base: GPT) -> Contender:
    contender = build("no_ddp", base)
    for param in contender.model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: None)
    contender.name = "no_ddp_empty_hooks"
    return contender


class _NoStreamOrder(StreamOrder):
    __slots__ = ()

    def note(self, index: int) -> None:
        pass

    def wait_for_producers(self, b: int) -> None:
        pass


def _variant(name: str, base: GPT) -> Contender:
    """gradsync with one part switched off or replaced (see the module's docstring)."""
    contender = build("gradsync", base)
    engine = contender.runner.engine
    device = engine.buckets.device
    if name == "gradsync_no_watch":
        engine.records.clock.watch = lambda b, pending: None
    elif name == "gradsync_wait_watch":
        clock, side = engine.records.clock, torch.cuda.Stream()

        def watch(b: int, pending: Any) -> None:
            events = clock.current
            if events is None or not isinstance(pending, dist.Work):
                return
            event = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                pending.wait()
                event.record(side)
            events.watched.append(b)
            events.bucket_done[b] = event

        clock.watch = watch
    elif name == "gradsync_untimed":
        engine.records.clock = CudaClock(device, capturing=lambda: True)
    elif name == "gradsync_no_stream_order":
        engine.streams = _NoStreamOrder(device)
    contender.name = name
    return contender


def _where_time_goes(c: Contender, data: tuple[torch.Tensor, torch.Tensor], steps: int = 20) -> dict[str, float]:
    """Host ms per step inside gradsync's entry points and the parts of a bucket's launch, each charged its
    own time only (lib/overhead.py's ``SectionTimer``: a launch's copy-in, collective and clock calls are
    not counted again in the launch, nor the launches in the hooks)."""
    engine = c.runner.engine
    clock, reduction, buckets = engine.records.clock, engine.reduction, engine.buckets
    targets = [
        (engine, "_on_grad_accumulated", "gradient hooks (besides launches)"),
        (engine, "_launch", "bucket launches (besides their parts below)"),
        (reduction, "start", "all_reduce and its Python (besides copy-in)"),
        (buckets, "gather_grads", "copy-in"),
        (clock, "launched", "clock: launch event"),
        (clock, "watch", "clock: completion callback"),
        (engine, "_finalize_callback", "end of backward"),
        (engine, "before_forward", "before the forward"),
        (engine, "arm", "after the forward"),
    ]
    timer = SectionTimer()
    for owner, attr, label in targets:
        setattr(owner, attr, timer.wrap(getattr(owner, attr), label))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(c, *data)
    torch.cuda.synchronize()
    whole = time.perf_counter() - start
    for owner, attr, _ in targets:
        delattr(owner, attr)
    per_step = {label: seconds / steps * 1e3 for label, seconds in timer.totals.items()}
    return {**per_step, "whole step": whole / steps * 1e3}


def _step_time_ratios(base: GPT, batch: int, rounds: int = 8, iters: int = 8) -> dict[str, Any]:
    """GPU step time (CUDA events, interleaved rounds) of gradsync's variants against torch's DDP at ``batch``."""
    tokens = torch.randint(0, base.wte.num_embeddings, (batch, 1024), device="cuda")
    data = (tokens, torch.roll(tokens, -1, dims=1))
    contenders = [build("torch_ddp", base), build("gradsync", base)]
    contenders += [_variant(name, base) for name in ("gradsync_untimed", "gradsync_no_watch")]
    for c in contenders:
        for _ in range(WARMUP):
            step(c, *data)
    for r in range(rounds):
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            timed_block(c, data, iters)
    reference = contenders[0]
    rows = {
        c.name: {
            "step_ms_median": statistics.median(c.step_s) * 1e3,
            "ratio_to_torch_ddp": paired_ratio(c.step_s, reference.step_s, iters),
        }
        for c in contenders
    }
    for c in contenders:
        c.runner = c.model = c.optimizer = None  # type: ignore[assignment]
    torch.cuda.empty_cache()
    return rows


def _host_block(c: Contender, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(BLOCK):
        step(c, *data)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / BLOCK


def _unit_costs() -> dict[str, float]:
    """Microseconds per call of what a hook or a bucket launch may call on CUDA."""
    device = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(device)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    torch.cuda.synchronize()
    calls = {
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "stream == stream": lambda: stream == stream,
        "stream in [stream]": lambda: stream in [stream],
        "torch.cuda.Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
        "event.record(stream)": lambda: event.record(stream),
        "event.query()": event.query,
        "torch.autograd.profiler.record_function": lambda: torch.autograd.profiler.record_function("x").__enter__(),
    }
    costs = {}
    for name, call in calls.items():
        n = 20000
        start = time.perf_counter()
        for _ in range(n):
            call()
        costs[name] = (time.perf_counter() - start) / n * 1e6
    tensor = torch.ones(256 * 1024, device=device)
    for name, with_callback in (("all_reduce(async) + get_future", False), ("... + add_done_callback", True)):
        n = 2000
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            future = dist.all_reduce(tensor, async_op=True).get_future()
            if with_callback:
                future.add_done_callback(lambda _: None)
        costs[name] = (time.perf_counter() - start) / n * 1e6
    side = torch.cuda.Stream()
    n = 2000
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        work = dist.all_reduce(tensor, async_op=True)
        with torch.cuda.stream(side):
            work.wait()
            event.record(side)
    costs["all_reduce(async) + wait and record on a side stream"] = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return costs


def _report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"# Where gradsync's host time goes on a GPU ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, gradsync (commit {revision()}), GPU {result.get('device', '?')}",
        f"- GPT-2-small shape, {result['parameters']} parameters, {result['buckets']} buckets; "
        f"batch {result['batch']} x 1024",
        "",
        "| contender | host ms per step (median of rounds) |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in result["host_ms_per_step_median"].items()]
    lines += ["", "| inside gradsync | host ms per step |", "|---|---:|"]
    lines += [f"| {what.strip()} | {ms:.3f} |" for what, ms in result["gradsync_host_ms_per_step_inside"].items()]
    lines += ["", "| call | us |", "|---|---:|"]
    lines += [f"| `{call}` | {us:.2f} |" for call, us in result["unit_costs_us"].items()]
    for key, rows in result.items():
        if key.startswith("step_time_batch_"):
            lines += ["", f"GPU step time at batch {key.rsplit('_', 1)[1]} x 1024 (CUDA events, interleaved):", ""]
            lines += ["| contender | step ms | / torch's DDP [90% CI] |", "|---|---:|---:|"]
            for name, row in rows.items():
                ratio, low, high = row["ratio_to_torch_ddp"]
                lines.append(f"| {name} | {row['step_ms_median']:.2f} | {ratio:.4f} [{low:.4f}, {high:.4f}] |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--step-time-batch", type=int, default=8, help="also: variants' GPU step time at this batch")
    args = parser.parse_args()
    if not nccl_world_of_one("gpu_host_profile"):
        return
    torch.manual_seed(0)
    base = GPT().cuda()
    tokens = torch.randint(0, base.wte.num_embeddings, (args.batch, 1024), device="cuda")
    data = (tokens, torch.roll(tokens, -1, dims=1))
    contenders = [build("no_ddp", base), _with_empty_hooks(base), build("torch_ddp", base), build("gradsync", base)]
    contenders += [_variant(name, base) for name in VARIANTS]
    for c in contenders:
        for _ in range(WARMUP):
            step(c, *data)
    host: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(ROUNDS):
        for c in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            host[c.name].append(_host_block(c, data))
    result: dict[str, Any] = {
        "batch": args.batch,
        "host_ms_per_step_median": {k: statistics.median(v) * 1e3 for k, v in host.items()},
        "host_ms_per_step_all": {k: [x * 1e3 for x in v] for k, v in host.items()},
        "unit_costs_us": _unit_costs(),
        "parameters": sum(1 for _ in base.parameters()),
        "device": torch.cuda.get_device_name(0),
    }
    ours = next(c for c in contenders if c.name == "gradsync")
    for c in contenders:
        if c is not ours:
            c.runner = c.model = c.optimizer = None  # type: ignore[assignment]
    torch.cuda.empty_cache()
    result["buckets"] = len(ours.runner.engine.buckets.storages)
    result["gradsync_host_ms_per_step_inside"] = _where_time_goes(ours, data)
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(20):
        step(ours, *data)
    torch.cuda.synchronize()
    profiler.disable()
    if args.step_time_batch:
        result[f"step_time_batch_{args.step_time_batch}"] = _step_time_ratios(base, args.step_time_batch)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    print(json.dumps({k: v for k, v in result.items() if k != "host_ms_per_step_all"}, indent=1))
    print(text.getvalue())
    path = report_path("gpu-host-profile")
    path.write_text("\n".join(_report(result)))
    print(f"report: {path}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_profile.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
