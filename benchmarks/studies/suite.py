"""The benchmark suite: gradsync against torch's DDP, no communication, one flat all-reduce and the naive version.

Run from the repository root (about 7 minutes on a quiet 2-core machine; it waits for other
processes to idle):

    python -m benchmarks suite
    python -m benchmarks suite --link 1gbit    # on a shaped link (root; lib/link.py)

The first is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.suite``;
with ``--link`` it is ``python -m benchmarks.studies.suite --link 1gbit``, which starts torchrun
inside the namespace itself.

Per workload (``lib/workloads.py``: ``mlp_many_small``, ``cnn_bn``, ``transformer``,
``large_grad``), synthetic data, fixed seeds, after waiting until other processes leave
the CPUs alone (lib/common.py's ``wait_for_quiet``; ``--no-wait-for-quiet`` skips that):

1. A short sweep of gradsync with ``gradient_as_bucket_view=True`` over bucket caps
   (``--caps``, plus ``"auto"`` when this gradsync accepts it); the fastest median is
   ``gradsync_best``.
2. The contenders of ``lib/contenders.py``, interleaved over rounds (see lib/common.py's
   [Note: how an iteration is timed]): median and p90 iteration time, the ratio to torch
   DDP's default, and the exposed communication (median minus the ``no_comm`` median).
   On ``large_grad`` a raw ``dist.all_reduce`` of one flat buffer of the gradient's size
   runs in the same rounds: the bandwidth limit of this machine.
3. On ``mlp_many_small``: Python time spent in gradsync per parameter (``lib/overhead.py``).
4. Peak RSS per rank, each contender in fresh processes (``lib/rss.py``).

Rank 0 writes ``benchmarks/results/YYYY-MM-DD-suite.md`` and ``-suite.png`` (ratios).
``--rss-only CONTENDER --workloads W [--cap MIB]`` measures one contender's peak RSS.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import contenders, launch, link, overhead, rss
from benchmarks.lib.common import (
    Contender,
    MachineLoad,
    environment_lines,
    interleave,
    mib,
    paired_ratio,
    report_path,
    summarise,
    today,
    train_step,
    wait_for_quiet,
)
from benchmarks.lib.contenders import CONTENDERS, Cap
from benchmarks.lib.workloads import WORKLOADS, Workload, gradient_size

BATCHES_PER_RANK = 4  # distinct batches cycled through
RAW = "raw_allreduce"
FORWARD = "forward_only"
FIRST_GRADIENT = "to_first_gradient"


@dataclass
class WorkloadResult:
    samples: dict[str, list[float]]
    sweep: dict[str, list[float]]
    best_cap: Cap
    iters: int  # iterations per contender per round: samples[r*iters:(r+1)*iters] is round r
    gradsync_comm_s: dict[str, tuple[float, float]] = field(default_factory=dict)  # (comm, exposed) per iteration
    waited_s: float = 0.0  # for a quiet machine, before measuring
    other_cores: float = 0.0  # CPU other processes used while measuring, in cores


# ---------------------------------------------------------------------- measurement
def make_batches(workload: Workload) -> list[Any]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    return [workload.make_batch(generator) for _ in range(BATCHES_PER_RANK)]


def make_contender(name: str, workload: Workload, base: torch.nn.Module, batches: list[Any], cap: Cap) -> Contender:
    model, after_backward = contenders.build(name, copy.deepcopy(base), cap)
    # A small learning rate: the weights must stay finite, their values do not matter.
    optimizer = contenders.optimizer(name, model, lr=1e-3, momentum=workload.momentum)
    contender = Contender(name, train_step(model, optimizer, workload.loss, batches, after_backward))
    contender.rest = lambda: optimizer.zero_grad(set_to_none=True)  # free .grad between blocks
    contender.model = model  # type: ignore[attr-defined]
    return contender


def raw_allreduce(nbytes: int) -> Contender:
    flat = torch.zeros(nbytes // 4)
    return Contender(RAW, lambda i: dist.all_reduce(flat))


def forward_only(workload: Workload, base: torch.nn.Module, batches: list[Any]) -> Contender:
    """Forward and loss of the bare module with autograd recording, no backward: the part of a step
    before which no gradient exists, so no communication can start."""
    model = copy.deepcopy(base)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        workload.loss(model(x), y)  # the graph is built, then dropped

    return Contender(FORWARD, step)


class _FirstGradient(Exception):
    """Raised by the first gradient's accumulation: ends that backward there."""


def to_first_gradient(workload: Workload, base: torch.nn.Module, batches: list[Any]) -> Contender:
    """Forward, loss and backward of the bare module up to the first accumulated parameter gradient
    (the backward is stopped there): before that no reducer has a byte to send."""
    model = copy.deepcopy(base)

    def stop(param: torch.Tensor) -> None:
        raise _FirstGradient

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(stop)

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        model.zero_grad(set_to_none=True)
        try:
            workload.loss(model(x), y).backward()
        except _FirstGradient:
            pass

    return Contender(FIRST_GRADIENT, step)


def sweep(workload: Workload, base: torch.nn.Module, batches: list[Any], caps: list[Cap], args: Any) -> Any:
    by_name = {contenders.sweep_name(cap): cap for cap in caps}
    runs = [make_contender(name, workload, base, batches, cap) for name, cap in by_name.items()]
    samples = interleave(runs, args.sweep_rounds, args.iters or workload.iters, args.warmup)
    best = min(samples, key=lambda name: summarise(samples[name]).median_ms)
    return samples, by_name[best]


def gradsync_comm_totals(runs: list[Contender]) -> dict[str, tuple[int, float, float]]:
    """(iterations, total comm s, total exposed comm s) from each gradsync contender's ddp.stats()."""
    totals = {}
    for run in runs:
        if run.name.startswith("gradsync"):
            s = run.model.stats()  # type: ignore[attr-defined]
            totals[run.name] = (s.iterations, s.avg_comm_s * s.iterations, s.avg_exposed_comm_s * s.iterations)
    return totals


def measure(workload: Workload, caps: list[Cap], args: Any) -> WorkloadResult:
    batches = make_batches(workload)
    torch.manual_seed(0)  # same weights on every rank and for every contender
    base = workload.build()
    sweep_samples, best = sweep(workload, base, batches, caps, args)
    gc.collect()
    runs = [make_contender(name, workload, base, batches, best) for name in CONTENDERS]
    # For the lower bound of an exact reducer (bound_lines) and, on large_grad, the bandwidth.
    runs += [raw_allreduce(gradient_size(workload)[2]), forward_only(workload, base, batches)]
    runs.append(to_first_gradient(workload, base, batches))
    before: dict[str, tuple[int, float, float]] = {}
    iters = args.iters or workload.iters
    samples = interleave(
        runs,
        args.rounds or workload.rounds,
        iters,
        args.warmup,
        after_warmup=lambda: before.update(gradsync_comm_totals(runs)),
    )
    comm = {}
    for name, (n, c, e) in gradsync_comm_totals(runs).items():
        n0, c0, e0 = before[name]
        per_iter = torch.tensor([(c - c0) / (n - n0), (e - e0) / (n - n0)], dtype=torch.float64)
        dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
        comm[name] = (per_iter[0].item(), per_iter[1].item())
    # Both DDPs hold reference cycles; free them now, not at interpreter exit after the
    # process group is gone (torch's DDP then sometimes aborts: "terminate called ...").
    runs.clear()
    gc.collect()
    return WorkloadResult(samples, sweep_samples, best, iters, comm)


def measure_overhead(args: Any) -> overhead.Overhead:
    workload = WORKLOADS["mlp_many_small"]
    batches = make_batches(workload)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return workload.build()

    def step_for(model: torch.nn.Module) -> Any:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=workload.momentum)
        return train_step(model, optimizer, workload.loss, batches)

    return overhead.measure(build, step_for, args.overhead_iters)


# ---------------------------------------------------------------------- report
def cap_text(cap: Cap) -> str:
    if isinstance(cap, tuple):
        return f"first {cap[0]:g} MiB, then {cap[-1]:g} MiB"
    return "auto" if cap == "auto" else f"{cap:g} MiB"


def results_table(results: dict[str, WorkloadResult], memory: dict[tuple[str, str], dict[str, float]]) -> list[str]:
    lines = [
        "| workload | contender | median ms | p90 ms | median / torch_ddp | per-round ratio [90% CI] "
        "| exposed comm ms | peak RSS MiB | growth MiB, it. 1-5 (- no_comm's) | growth MiB, it. 6-8 (- no_comm's) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, result in results.items():
        stats = {name: summarise(result.samples[name]) for name in CONTENDERS}
        floor, reference = stats["no_comm"].median_ms, stats["torch_ddp"].median_ms
        floor_mem = memory.get((workload, "no_comm"))
        for name, s in stats.items():
            label = f"{name} ({cap_text(result.best_cap)})" if name in ("gradsync_best", "gradsync_fused") else name
            exposed = f"{s.median_ms - floor:.2f}" if name != "no_comm" else "-"
            rss_cells = memory_cells(memory.get((workload, name)), floor_mem)
            ratio, low, high = paired_ratio(result.samples[name], result.samples["torch_ddp"], result.iters)
            lines.append(
                f"| {workload} | {label} | {s.median_ms:.2f} | {s.p90_ms:.2f} | {s.median_ms / reference:.2f} "
                f"| {ratio:.2f} [{low:.2f}, {high:.2f}] | {exposed} | {rss_cells} |"
            )
    return lines


def memory_cells(mem: dict[str, float] | None, floor: dict[str, float] | None) -> str:
    if mem is None:
        return "- | - | -"
    if floor is None:
        return f"{mem['peak_mib']:.0f} | {mem['growth_mib']:.0f} | {mem['steady_mib']:.0f}"
    return (
        f"{mem['peak_mib']:.0f} | {mem['growth_mib']:.0f} ({mem['growth_mib'] - floor['growth_mib']:+.0f}) "
        f"| {mem['steady_mib']:.0f} ({mem['steady_mib'] - floor['steady_mib']:+.0f})"
    )


def bound_ms(result: WorkloadResult) -> tuple[float, float, float, float]:
    """(bound, no_comm, forward, one flat all-reduce of every gradient) medians in ms."""
    no_comm, forward, flat = (summarise(result.samples[n]).median_ms for n in ("no_comm", FORWARD, RAW))
    return max(no_comm, forward + flat), no_comm, forward, flat


def tight_bound_ms(result: WorkloadResult) -> tuple[float, float] | None:
    """(max(no_comm, to first gradient + flat all-reduce), to first gradient) in ms; None in older runs."""
    if FIRST_GRADIENT not in result.samples:
        return None
    _, no_comm, _, flat = bound_ms(result)
    first = summarise(result.samples[FIRST_GRADIENT]).median_ms
    return max(no_comm, first + flat), first


def bound_lines(results: dict[str, WorkloadResult]) -> list[str]:
    lines = [
        "An exact (uncompressed) reducer cannot beat either of two limits, so its step takes at least",
        "`bound = max(no_comm, forward + flat all-reduce)`:",
        "",
        "- `no_comm`: the step without communication (the compute);",
        "- `forward + flat all-reduce`: no gradient exists before backward starts, i.e. before forward ends",
        f"  (`{FORWARD}`: forward and loss of the bare module, median), and every gradient byte must then cross",
        f"  the link (`{RAW}`: one `dist.all_reduce` of a flat buffer of all gradients, median, in the same rounds).",
        "  Perfect overlap would hide all of backward and the optimizer step behind that all-reduce.",
        "",
        "Each contender's median over the bound (1.00 = at the limit):",
        "",
        "| workload | bound ms | no_comm | forward | flat all-reduce | " + " | ".join(CONTENDERS) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(CONTENDERS),
    ]
    for workload, result in results.items():
        bound, no_comm, forward, flat = bound_ms(result)
        ratios = " | ".join(f"{summarise(result.samples[n]).median_ms / bound:.2f}" for n in CONTENDERS)
        lines.append(f"| {workload} | {bound:.1f} | {no_comm:.1f} | {forward:.1f} | {flat:.1f} | {ratios} |")
    tight = {w: tight_bound_ms(r) for w, r in results.items()}
    if any(t is not None for t in tight.values()):
        lines += [
            "",
            "A tighter limit counts that the first gradient exists only some way into backward "
            f"(`{FIRST_GRADIENT}`: forward, loss and",
            "backward of the bare module up to the first accumulated parameter gradient, where the backward is "
            "stopped): `tight = max(no_comm, to first gradient + flat all-reduce)`. Each contender over it:",
            "",
            "| workload | tight bound ms | to first gradient | " + " | ".join(CONTENDERS) + " |",
            "|---|---:|---:|" + "---:|" * len(CONTENDERS),
        ]
        for workload, result in results.items():
            if tight[workload] is None:
                continue
            limit, first = tight[workload]
            ratios = " | ".join(f"{summarise(result.samples[n]).median_ms / limit:.2f}" for n in CONTENDERS)
            lines.append(f"| {workload} | {limit:.1f} | {first:.1f} | {ratios} |")
    return lines


def sweep_table(results: dict[str, WorkloadResult]) -> list[str]:
    lines = ["| workload | setting | median ms | p90 ms | chosen |", "|---|---|---:|---:|:---:|"]
    for workload, result in results.items():
        for name, times in result.sweep.items():
            s = summarise(times)
            chosen = "yes" if name == contenders.sweep_name(result.best_cap) else ""
            lines.append(f"| {workload} | {name} | {s.median_ms:.2f} | {s.p90_ms:.2f} | {chosen} |")
    return lines


def bandwidth_lines(result: WorkloadResult, nbytes: int) -> list[str]:
    gb = nbytes / 1e9
    floor = summarise(result.samples["no_comm"]).median_ms / 1e3
    raw = summarise(result.samples[RAW]).median_ms / 1e3
    lines = [
        f"Bytes all-reduced per iteration: {nbytes:,} ({mib(nbytes)} MiB of fp32 gradients). Bandwidth = those "
        "bytes / a time. With 2 ranks a ring all-reduce moves 2(W-1)/W = 1 times the buffer per rank each way, "
        "so this is also the bus bandwidth.",
        "",
        "| what | time per iteration ms | bandwidth GB/s |",
        "|---|---:|---:|",
        f"| raw `dist.all_reduce` of one flat {mib(nbytes)} MiB buffer (median, slowest rank) | {raw * 1e3:.1f} "
        f"| {gb / raw:.2f} |",
    ]
    for name in ("gradsync", "gradsync_best", "torch_ddp", "torch_ddp_view", "naive", "one_allreduce"):
        exposed = summarise(result.samples[name]).median_ms / 1e3 - floor
        bw = f"{gb / exposed:.2f}" if exposed > 0 else "-"
        lines.append(f"| {name}: exposed comm (median - no_comm median) | {exposed * 1e3:.1f} | {bw} |")
    for name, (comm, exposed) in result.gradsync_comm_s.items():
        lines.append(
            f"| {name}: `ddp.stats().avg_comm_s` (first bucket launch to last bucket done) | {comm * 1e3:.1f} "
            f"| {gb / comm:.2f} |"
        )
        lines.append(
            f"| {name}: `ddp.stats().avg_exposed_comm_s` (backward compute done to last bucket done) "
            f"| {exposed * 1e3:.1f} | - |"
        )
    return lines


def write_chart(results: dict[str, WorkloadResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in CONTENDERS if c != "torch_ddp"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(shown)
    for k, name in enumerate(shown):
        ratios = [
            summarise(r.samples[name]).median_ms / summarise(r.samples["torch_ddp"]).median_ms for r in results.values()
        ]
        positions = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(results))]
        bars = ax.bar(positions, ratios, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, label="torch_ddp (= 1)")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_yscale("log")  # naive is many times slower; a log axis keeps the others readable
    ax.set_yticks([0.5, 0.75, 1, 1.5, 2, 5, 10], ["0.5", "0.75", "1", "1.5", "2", "5", "10"])
    ax.minorticks_off()
    ax.set_ylabel("median iteration time / torch DDP default (log scale)")
    ax.set_title(f"gradsync benchmark suite, {dist.get_world_size()} ranks, gloo on CPU ({today()})")
    ax.legend(fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict[str, WorkloadResult], memory: Any, over: Any, load: MachineLoad, args: Any) -> Path:
    command = launch.command_line()  # the exact invocation, options included
    lines = [f"# Benchmark suite: gradsync vs torch DDP ({today()})", "", *environment_lines(command)]
    lines += [
        f"- machine load over all workloads: {load.describe()}; before each workload the suite waits until "
        "other processes use under 0.3 cores (5 s windows, at most 10 min), see the workload list",
        f"- {args.warmup} warm-up iterations per contender, then per workload its rounds x iterations (below), "
        "contenders interleaved, the starting contender rotating each round; sweep: "
        f"{args.sweep_rounds} rounds",
        "- iteration = zero_grad(set_to_none=True), forward, loss, backward, SGD step (lr 1e-3); its time is "
        "the slowest rank's",
        f"- bucket caps swept for `gradsync_best` (with gradient_as_bucket_view=True): {args.caps_used}",
        "- peak RSS: each contender in fresh processes (rss.py), max over ranks; growth = high-water mark over "
        "iterations 1-5 (bucket rebuild included) or 6-8 (steady state) minus the RSS before building the "
        "model; in parentheses the difference to no_comm's growth (what data parallelism costs)",
        "",
        "Contenders:",
        "",
        *[f"- `{name}`: {text}" for name, text in contenders.DESCRIPTIONS.items()],
        "",
        "Workloads:",
        "",
    ]
    for name in results:
        w = WORKLOADS[name]
        tensors, params, nbytes = gradient_size(w)
        rounds, iters = args.rounds or w.rounds, args.iters or w.iters
        r = results[name]
        lines.append(
            f"- `{name}`: {w.description}; {tensors} parameter tensors, {params / 1e6:.2f} M parameters, "
            f"{mib(nbytes)} MiB of gradients; {rounds} rounds x {iters} iterations; measured after waiting "
            f"{r.waited_s:.0f} s for a quiet machine, other processes then used {r.other_cores:.2f} cores"
        )
    chart = report_path("suite", "png")
    lines += ["", "## Iteration time and memory", "", f"![ratios]({chart.name})", "", *results_table(results, memory)]
    lines += ["", "## Distance to the limit", "", *bound_lines(results)]
    lines += ["", "## Bucket-cap sweep (gradient_as_bucket_view=True)", "", *sweep_table(results)]
    if "large_grad" in results:
        lines += ["", "## large_grad: achieved all-reduce bandwidth", ""]
        lines += bandwidth_lines(results["large_grad"], gradient_size(WORKLOADS["large_grad"])[2])
    if over is not None:
        extra = None
        if "mlp_many_small" in results:
            samples = results["mlp_many_small"].samples
            extra = summarise(samples["gradsync"]).median_ms - summarise(samples["torch_ddp"]).median_ms
        lines += [
            "",
            "## Python time spent in gradsync per parameter",
            "",
            *overhead.report_lines(over, "mlp_many_small", extra),
        ]
    write_chart(results, chart)
    path = report_path("suite")
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------- main
def parse_cap(text: str) -> Cap:
    """``auto``, MiB (``4``), or a first bucket's cap and the others' (``1+4``: bucket_cap_mb_list)."""
    if text == "auto":
        return text
    if "+" in text:
        return tuple(float(part) for part in text.split("+"))
    return float(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=5, help="iterations per contender before timing")
    parser.add_argument("--rounds", type=int, default=None, help="override every workload's rounds")
    parser.add_argument("--iters", type=int, default=None, help="override iterations per contender per round")
    parser.add_argument("--sweep-rounds", type=int, default=5)
    caps_help = "MiB, auto, or FIRST+REST MiB"
    parser.add_argument("--caps", nargs="+", type=parse_cap, default=[1.0, 4.0, 25.0], help=caps_help)
    parser.add_argument("--overhead-iters", type=int, default=50)
    parser.add_argument(
        "--no-wait-for-quiet",
        dest="wait_for_quiet",
        action="store_false",
        help="measure at once instead of waiting (up to 10 min per workload) for other processes to idle",
    )
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--rss-only", choices=CONTENDERS, help="measure one contender's peak RSS and exit")
    parser.add_argument("--cap", type=parse_cap, default=None, help="bucket_cap_mb for --rss-only gradsync_best")
    parser.add_argument(
        "--link",
        help="rate of a shaped loopback link (1gbit, 10gbit, ...): start with python, not torchrun (see lib/link.py)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    if args.rss_only:
        rss.child_main(args.rss_only, args.workloads[0], args.cap)
        dist.destroy_process_group()
        return
    caps = list(args.caps)
    if "auto" not in caps and contenders.auto_cap_supported():
        caps.append("auto")
    args.caps_used = ", ".join(str(c) for c in caps) + ("" if "auto" in caps else ' ("auto" is not accepted yet)')
    load = MachineLoad()
    load.start()
    results = {}
    for name in args.workloads:
        waited = wait_for_quiet() if args.wait_for_quiet else 0.0
        during = MachineLoad()
        during.start()
        start = time.perf_counter()
        results[name] = measure(WORKLOADS[name], caps, args)
        during.stop()
        results[name].waited_s, results[name].other_cores = waited, during.other_cores()
        if dist.get_rank() == 0:
            print(f"{name}: measured in {time.perf_counter() - start:.1f} s", flush=True)
    load.stop()
    if args.wait_for_quiet and not args.skip_overhead:
        wait_for_quiet()
    over = None if args.skip_overhead else measure_overhead(args)
    memory = {}
    if not args.skip_rss:
        tuned = ("gradsync_best", "gradsync_fused")
        jobs = [(w, c, results[w].best_cap if c in tuned else None) for w in results for c in CONTENDERS]
        memory = rss.spawn_all(jobs, launch.main_module())
    if dist.get_rank() == 0:
        path = write_report(results, memory, over, load, args)
        print(path.read_text())
        print(f"report: {path}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
