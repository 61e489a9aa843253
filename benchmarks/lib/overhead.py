"""Python time spent inside gradsync per iteration, and per parameter.

gradsync's per-parameter work is Python called from autograd (torch's DDP does the
same in C++), so a model with hundreds of small tensors pays it hundreds of times per
backward. Two measurements on one workload, both on a fresh gradsync DDP (default
arguments):

1. ``SectionTimer``: the entry points autograd and the user call into gradsync
   (``DistributedDataParallel.forward``, the reducer's per-parameter hook, its per-bucket
   launch, its end-of-backward finalize, ...) are wrapped; wall time is charged to the
   innermost open section (exclusive time). Time spent in the user's module forward and
   waiting for all-reduces (``bucket_set.wait_for``) is charged to sections of its own and
   left out of gradsync's total. What remains is gradsync's Python plus the torch calls
   it makes (copies, launching collectives): what a C++ reducer would not pay in Python.
   The wrapper itself costs a little per call; it is measured and reported, not subtracted.
2. ``cProfile`` over as many iterations of a second, unwrapped DDP: self time (``tottime``) of each function in
   ``src/gradsync``, for a breakdown. cProfile's own overhead inflates these several
   times over; read them as proportions.
3. ``main_thread_cpu``: CPU time of the training thread per iteration for gradsync, torch's
   DDP and the bare module, interleaved: each reducer's own cost measured the same way,
   free of the preemption that inflates wall-clock sections on an oversubscribed machine.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import gradsync.engine.bucket_set
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.ddp import TorchDDP
from gradsync.engine.reducer import Reducer

# (owner, attribute, section); owner is patched for the duration of the measurement.
PATCHES: list[tuple[Any, str, str]] = [
    (GradsyncDDP, "forward", "DDP.forward (checks, buffer sync, graph hooks)"),
    (Reducer, "arm", "Reducer.arm (output hooks, after a synced forward)"),
    (Reducer, "_on_output_backward", "Reducer._on_output_backward (once per backward)"),
    (Reducer, "_on_grad_accumulated", "Reducer._on_grad_accumulated (per parameter)"),
    (Reducer, "_launch", "Reducer._launch (per bucket: copy in, start all-reduce)"),
    (Reducer, "_finalize_callback", "Reducer._finalize_callback (wait, copy out)"),
    (gradsync.engine.bucket_set, "wait_for", "[not gradsync] waiting for the all-reduce"),
]
NOT_GRADSYNC = "[not gradsync]"
MODULE_FORWARD = "[not gradsync] the wrapped module's forward"


class SectionTimer:
    """Charges wall time to the innermost open section; time outside all sections is not charged."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[str] = []
        self._last = 0.0

    def _switch(self) -> None:
        t = time.perf_counter()
        if self._stack:
            self.totals[self._stack[-1]] += t - self._last
        self._last = t

    def wrap(self, fn: Callable[..., Any], section: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._switch()
            self._stack.append(section)
            self.calls[section] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._switch()
                self._stack.pop()

        return timed

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def wrapper_cost_s(calls: int = 20000) -> float:
    """Wall seconds the wrapper adds to one call (an empty function, wrapped vs bare)."""

    def noop() -> None:
        pass

    def loop(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - start

    return (loop(SectionTimer().wrap(noop, "noop")) - loop(noop)) / calls


@contextmanager
def patched(timer: SectionTimer) -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PATCHES]
    try:
        for owner, name, section in PATCHES:
            setattr(owner, name, timer.wrap(getattr(owner, name), section))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@dataclass
class Overhead:
    params: int
    iterations: int
    sections_s: dict[str, float]  # per iteration, slowest rank
    calls: dict[str, float]  # per iteration
    wrapper_cost_us: float
    profile_rows: list[tuple[str, float, float]]  # (function, calls/iter, tottime us/iter), rank 0
    cpu_s: dict[str, float]  # main-thread CPU per iteration (main_thread_cpu), slowest rank

    @property
    def gradsync_s(self) -> float:
        return sum(s for name, s in self.sections_s.items() if not name.startswith(NOT_GRADSYNC))


def measure(
    build: Callable[[], torch.nn.Module], step_for: Callable[[torch.nn.Module], Callable[[int], None]], iters: int
) -> Overhead:
    """Training-thread CPU of both DDPs first (on a clean process), then gradsync's sections, then cProfile."""
    gc.collect()
    cpu_s = main_thread_cpu(build, step_for, iters)
    gc.collect()
    timer = SectionTimer()
    with patched(timer):
        ddp = GradsyncDDP(build())  # built while patched: the reducer's hooks bind the wrappers
        inner = ddp.module
        inner.forward = timer.wrap(inner.forward, MODULE_FORWARD)
        step = step_for(ddp)
        for i in range(3):  # warm-up and bucket rebuild
            step(i)
        dist.barrier()
        timer.reset()
        for i in range(iters):
            step(i)
    names = sorted(timer.totals)
    per_iter = torch.tensor([timer.totals[n] / iters for n in names], dtype=torch.float64)
    dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
    params = len(list(ddp.parameters()))
    del ddp, inner, step
    fresh = GradsyncDDP(build())  # unpatched, for cProfile
    step = step_for(fresh)
    for i in range(3):
        step(i)
    profile_rows = _profile(step, iters)
    return Overhead(
        params=params,
        iterations=iters,
        sections_s=dict(zip(names, per_iter.tolist())),
        calls={n: timer.calls[n] / iters for n in names},
        wrapper_cost_us=wrapper_cost_s() * 1e6,
        profile_rows=profile_rows,
        cpu_s=cpu_s,
    )


CPU_CONTENDERS = ("gradsync", "torch_ddp", "no_comm")


def main_thread_cpu(
    build: Callable[[], torch.nn.Module],
    step_for: Callable[[torch.nn.Module], Callable[[int], None]],
    iters: int,
    rounds: int = 5,
) -> dict[str, float]:
    """CPU seconds of the training thread per iteration, for gradsync, torch's DDP and the bare module.

    [Note: main-thread CPU]
    Wall time on an oversubscribed machine charges a section for the time it was preempted;
    CPU time of the one thread that runs forward, backward and the reducer does not. Both DDPs
    do their bookkeeping and copies on this thread (torch's C++ reducer runs in the autograd
    thread, which on CPU is the caller's) and their collectives on gloo's threads, which are
    not counted. So (DDP - bare module) is each reducer's own per-iteration cost, the same
    measure for both. Interleaved over ``rounds``; the slowest rank's sum, per iteration.
    """
    wrappers: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
        "gradsync": GradsyncDDP,
        "torch_ddp": TorchDDP,  # torch's own class, even under GRADSYNC_INSTALL=1
        "no_comm": lambda module: module,
    }
    steps = {name: step_for(wrap(build())) for name, wrap in wrappers.items()}
    for step in steps.values():
        for i in range(3):
            step(i)
    totals = dict.fromkeys(steps, 0.0)
    for r in range(rounds):
        for k in range(len(CPU_CONTENDERS)):
            name = CPU_CONTENDERS[(r + k) % len(CPU_CONTENDERS)]
            dist.barrier()
            start = time.thread_time()
            for i in range(iters):
                steps[name](i)
            totals[name] += time.thread_time() - start
    per_iter = torch.tensor([totals[n] / (iters * rounds) for n in CPU_CONTENDERS], dtype=torch.float64)
    dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
    steps.clear()
    return dict(zip(CPU_CONTENDERS, per_iter.tolist()))


def _profile(step: Callable[[int], None], iters: int, top: int = 10) -> list[tuple[str, float, float]]:
    profiler = cProfile.Profile()
    dist.barrier()
    profiler.enable()
    for i in range(iters):
        step(i)
    profiler.disable()
    rows = []
    for (filename, line, func), (_, ncalls, tottime, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        if "/gradsync/" in filename and "/benchmarks/" not in filename:
            where = filename.split("/gradsync/")[-1]
            rows.append((f"{where}:{line} {func}", ncalls / iters, tottime / iters * 1e6))
    rows.sort(key=lambda row: -row[2])
    total = sum(r[2] for r in rows)
    return [("(all gradsync functions)", sum(r[1] for r in rows), total), *rows[:top]]


def report_lines(result: Overhead, workload: str, extra_ms_vs_torch: float | None) -> list[str]:
    n, per_iter_ms = result.params, result.gradsync_s * 1e3
    lines = [
        f"Workload `{workload}`, {n} parameter tensors, gradsync DDP with default arguments, "
        f"{result.iterations} iterations timed after 3 warm-up iterations; per iteration, slowest rank.",
        "",
        f"**Python time inside gradsync: {per_iter_ms:.2f} ms per iteration = "
        f"{result.gradsync_s / n * 1e6:.1f} µs per parameter per iteration.**",
    ]
    if extra_ms_vs_torch is not None:
        lines.append(
            f"For scale: gradsync's median iteration was {extra_ms_vs_torch:+.2f} ms against torch DDP's in the "
            f"interleaved run, {extra_ms_vs_torch * 1e3 / n:+.1f} µs per parameter."
        )
    cpu = result.cpu_s
    ours, theirs = cpu["gradsync"] - cpu["no_comm"], cpu["torch_ddp"] - cpu["no_comm"]
    lines += [
        "",
        f"**Training-thread CPU above the bare module ([Note: main-thread CPU] in overhead.py): gradsync "
        f"{ours * 1e3:.2f} ms per iteration = {ours / n * 1e6:.1f} µs per parameter; torch DDP's C++ reducer "
        f"{theirs * 1e3:.2f} ms = {theirs / n * 1e6:.1f} µs per parameter** (bare module "
        f"{cpu['no_comm'] * 1e3:.2f} ms). Both include the per-bucket copies and collective launches.",
        "",
    ]
    lines += [
        f"Each wrapped call adds about {result.wrapper_cost_us:.2f} µs of timer overhead to these numbers "
        "(not subtracted).",
        "",
        "| section (exclusive time) | calls / iteration | ms / iteration | µs / call |",
        "|---|---:|---:|---:|",
    ]
    for name, seconds in sorted(result.sections_s.items(), key=lambda item: -item[1]):
        calls = result.calls.get(name, 0.0)
        per_call = seconds / calls * 1e6 if calls else 0.0
        lines.append(f"| {name} | {calls:.0f} | {seconds * 1e3:.2f} | {per_call:.1f} |")
    lines += [
        "",
        "cProfile self time of gradsync's functions (rank 0; profiler overhead included, compare rows "
        "with each other, not with the table above):",
        "",
        "| function | calls / iteration | tottime µs / iteration |",
        "|---|---:|---:|",
    ]
    lines += [f"| `{name}` | {calls:.0f} | {us:.0f} |" for name, calls, us in result.profile_rows]
    return lines
