"""What one collective costs on this machine: wall time, and CPU time per thread.

Run from the repository root (under a minute):

    python -m benchmarks collective_cost

which is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.collective_cost``.

Whether overlapping communication with backward can pay depends on what a collective
spends its time on. Waiting for a wire leaves the CPU to backward; copying bytes through
loopback sockets takes it from backward. Per message size, interleaved over rounds, this
times ``dist.all_reduce`` and ``dist.broadcast`` and, for a world of two, the same sum by a
point-to-point exchange (each rank sends its whole buffer and adds the one it receives; the
sum is bitwise the same on both ranks, since a + b == b + a). For each, rank 0's CPU time is
read per thread from ``/proc/self/task`` (user and system time; Linux only): the training
thread that issues the call, and the threads gloo runs it on. The dominant cost is system
time in gloo's socket thread, i.e. kernel copies, which competes with compute for the same
cores. Writes ``benchmarks/results/YYYY-MM-DD-collective-cost.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.lib import launch
from benchmarks.lib.common import environment_lines, report_path

SIZES = [256, 1 << 16, 1 << 18, 1 << 20, 1 << 22]  # fp32 elements
ROUNDS = 6
TARGET_BYTES_PER_BLOCK = 64 << 20  # repetitions per block: about this many bytes, 20 to 200 calls


def thread_cpu_s() -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds per thread name, summed over threads of the same name."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, tuple[float, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        user, system = totals.get(name, (0.0, 0.0))
        totals[name] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
    return totals


def exchange_sum(tensor: torch.Tensor, scratch: torch.Tensor) -> None:
    peer = 1 - dist.get_rank()
    ops = [dist.P2POp(dist.isend, tensor, peer), dist.P2POp(dist.irecv, scratch, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    tensor.add_(scratch)


def contenders(numel: int) -> dict[str, Callable[[], None]]:
    tensor, scratch = torch.ones(numel), torch.empty(numel)
    calls = {
        "all_reduce": lambda: dist.all_reduce(tensor),
        "broadcast": lambda: dist.broadcast(tensor, src=0),
    }
    if dist.get_world_size() == 2:
        calls["exchange + add"] = lambda: exchange_sum(tensor, scratch)
    return calls


def measure(numel: int) -> dict[str, tuple[float, dict[str, tuple[float, float]]]]:
    """Per contender: (median wall s per call over rounds, CPU s per call per thread name)."""
    calls = contenders(numel)
    repeats = min(200, max(20, TARGET_BYTES_PER_BLOCK // (4 * numel)))
    walls: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, dict[str, tuple[float, float]]] = {name: {} for name in calls}
    for call in calls.values():
        call()  # warm-up: connections, allocations
    for r in range(ROUNDS):
        names = list(calls)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            before, start = thread_cpu_s(), time.perf_counter()
            for _ in range(repeats):
                calls[name]()
            walls[name].append((time.perf_counter() - start) / repeats)
            after = thread_cpu_s()
            for thread, (user, system) in after.items():
                u0, s0 = before.get(thread, (0.0, 0.0))
                acc = cpu[name].get(thread, (0.0, 0.0))
                cpu[name][thread] = (acc[0] + (user - u0) / repeats, acc[1] + (system - s0) / repeats)
    return {
        name: (statistics.median(walls[name]), {t: (u / ROUNDS, s / ROUNDS) for t, (u, s) in cpu[name].items()})
        for name in calls
    }


def report(results: dict[int, dict[str, tuple[float, dict[str, tuple[float, float]]]]]) -> str:
    lines = [
        f"# What one collective costs ({time.strftime('%Y-%m-%d')})",
        "",
        *environment_lines(launch.command_line()),
        f"- {ROUNDS} rounds, contenders interleaved; per block as many calls as make ~64 MiB (20 to 200)",
        "- wall: median over rounds of the mean per call on rank 0; CPU: rank 0's threads, per call, "
        "user + system (system in parentheses), from /proc (10 ms ticks, averaged over many calls)",
        "",
        "| fp32 elements | MiB | collective | wall ms | CPU ms, all threads (system) | training thread | "
        "gloo socket thread (`gloo_tcp_loop`) | gloo workers (`pt_gloo_runloop`) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for numel, per_call in results.items():
        for name, (wall, threads) in per_call.items():
            total_user = sum(u for u, _ in threads.values())
            total_sys = sum(s for _, s in threads.values())

            def cell(prefix: str, threads: dict[str, tuple[float, float]] = threads) -> str:
                user = sum(u for t, (u, _) in threads.items() if t.startswith(prefix))
                system = sum(s for t, (_, s) in threads.items() if t.startswith(prefix))
                return f"{(user + system) * 1e3:.3f} ({system * 1e3:.3f})"

            main = next((t for t in threads if not t.startswith(("gloo", "pt_gloo"))), "python")
            lines.append(
                f"| {numel:,} | {numel * 4 / 2**20:.3g} | {name} | {wall * 1e3:.3f} | "
                f"{(total_user + total_sys) * 1e3:.3f} ({total_sys * 1e3:.3f}) | {cell(main)} | "
                f"{cell('gloo_tcp_loop')} | {cell('pt_gloo_runloop')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {numel: measure(numel) for numel in SIZES}
    if dist.get_rank() == 0:
        path = report_path("collective-cost")
        path.write_text(report(results))
        print(f"report: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
