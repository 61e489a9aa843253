"""ZeRO-1/2 (ShardedOptimizer) against DDP, ZeroRedundancyOptimizer and FSDP2: memory per rank, bytes, speed.

Run from the repository root (wait until the machine is otherwise idle for ``speed``):

    python -m benchmarks zero memory                          # ~13 min: 1-4 ranks, 100.8 M parameters, 7 setups
    python -m benchmarks zero memory --world-sizes 2 4 --setups zero2_view zero1_view --snapshot zero2_view \
        zero1_view --label snapshot                           # holders named by gradsync's functions
    python -m benchmarks zero speed --link 1gbit              # ~2.5 min: transformer, 2 ranks, shared link
    python -m benchmarks zero speed --link 1gbit --per-rank-links --world-sizes 2 4 --iters 3   # ~4.5 min
    python -m benchmarks zero speed --link 1gbit --per-rank-links --world-sizes 2 4 --rounds 16 --iters 3 \
        --setups gradsync_ddp zero2 torch_zero              # ~4.7 min; 16+ rounds: intervals of +-1-2%
    python -m benchmarks zero speed --workload large_grad --setups gradsync_ddp zero2 zero2_no_overlap zero1 \
        torch_zero no_comm --rounds 8 --iters 3               # ~2.5 min, plain loopback
    python -m benchmarks zero speed --link 1gbit --per-rank-links --iters 3 --setups gradsync_ddp zero2 \
        zero2_whole zero2_no_overlap zero2_no_overlap_whole   # gloo's exchanges in segments vs one message per peer

(exactly ``OMP_NUM_THREADS=1 python -m benchmarks.studies.zero PART ...``). A launcher, like the
scaling study: it starts its ranks itself, under ``torchrun --nproc-per-node W`` (inside a shaped
namespace with ``--link``, lib/link.py) or, with ``--per-rank-links``, one process per rank behind
its own link. Every setup trains with AdamW (lib/zero_contenders.py lists them).

``memory``: for each world size (``--world-sizes``, default 1 2 3 4) and setup, fresh processes
build a stack of ``--layers`` x Linear(``--width``) (default 96 x 1024: 100.8 M parameters, 384
MiB of fp32 parameters) and train ``--iterations`` (4) iterations, batch 4, while a counting
wrapper around torch's CPU allocator logs every allocation and free ([Note: model-state memory] in
lib/zero_contenders.py; compiled once with torch's cpp_extension, so it needs a C++ compiler). Per
rank: the exact peak of live torch allocations over all iterations and over the steady ones
(after the bucket rebuild at iteration 1), what held the bytes at each peak, and peak RSS
(high-water mark over the RSS before building, lib/rss.py). Compared with the analytic bytes per
parameter of docs/zero.md; a PNG draws memory per rank against world size with those lines.
``--snapshot SETUP ...`` also records Python frames for those setups, so their holders name
gradsync's functions. ``MALLOC_*`` variables in the environment are passed on and named in the
report.

``speed``: for each world size, every setup on one workload (``--workload``, default
``transformer``), interleaved over rounds (lib/common.py's [Note: how an iteration is timed]); the
per-round ratio to gradsync DDP and to torch DDP + ZeroRedundancyOptimizer with 90% intervals,
the median time of ``optimizer.step()``, page faults and system CPU per step, and, on a shaped
link, bytes on the wire per step counted on the namespace's devices ([Note: bytes on the wire]).

Reports: ``benchmarks/results/YYYY-MM-DD-zero-memory[-RATE][-LABEL].md`` (+ ``.png``) and
``YYYY-MM-DD-zero-speed-WORKLOAD[-RATE][-per-rank][-LABEL].md``. The report says so when
src/gradsync (outside elastic/) changed while the setups ran.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lib import launch, link, rss
from benchmarks.lib import zero_contenders as zc
from benchmarks.lib.common import (
    RESULTS_DIR,
    Contender,
    MachineLoad,
    interleave,
    paired_ratio,
    revision,
    summarise,
    today,
    train_step,
)
from benchmarks.lib.workloads import WORKLOADS, gradient_size

MEMORY_SETUPS = ["gradsync_ddp", "gradsync_ddp_view", "torch_zero", "zero1_view", "zero2_view", "zero2", "fsdp2"]
SPEED_SETUPS = [
    "gradsync_ddp",
    "zero2",
    "zero2_no_overlap",
    "zero2_backward",
    "zero1",
    "torch_ddp",
    "torch_zero",
    "fsdp2",
    "no_comm",
]
SHARDED_2 = ("zero2", "zero2_no_overlap", "zero2_backward", "zero2_backward_no_overlap")  # held to the speed targets
REFERENCE, ZERO_TORCH = "gradsync_ddp", "torch_zero"
BATCH = 4
MIB = 2**20


# ---------------------------------------------------------------------- memory worker (one setup, fresh processes)
def linear_stack(layers: int, width: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def labelled_step(model: nn.Module, optimizer: zc.TimedOptimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    with zc.label("zero_grad"):
        optimizer.zero_grad(set_to_none=True)
    with zc.label("forward"):
        loss = nn.functional.mse_loss(model(batch[0]), batch[1])
    with zc.label("backward"):
        loss.backward()
    with zc.label("step"):
        optimizer.step()
        optimizer.settle()


def memory_worker(args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [(torch.randn(BATCH, args.width, generator=generator),) * 2 for _ in range(2)]
    gc.collect()
    trace = zc.AllocationTrace(with_stack=args.setup in (args.snapshot or []))
    steady_from = min(2, args.iterations - 1)  # iterations 0 and 1 hold one-time costs (the bucket rebuild)
    with trace:
        baseline = rss.reset_peak()
        with zc.label("build"):
            torch.manual_seed(0)
            module = linear_stack(args.layers, args.width)
            params = sum(p.numel() for p in module.parameters())
            model, optimizer = zc.build(args.setup, module)
        for i in range(args.iterations):
            if i == steady_from:
                first_peak = rss.peak_mib()
                rss.reset_peak()
            with zc.label(f"iter{i}"):
                labelled_step(model, optimizer, batches[i % 2])
        dist.barrier()
        steady_peak = rss.peak_mib()
    per_iteration = {i: trace.peak(f"iter{i}") for i in range(args.iterations)}
    steady = max((per_iteration[i] for i in range(steady_from, args.iterations)), key=lambda p: p.nbytes)
    overall = max(per_iteration.values(), key=lambda p: p.nbytes)
    result = {
        "rank": dist.get_rank(),
        "params": params,
        "buckets": zc.bucket_bytes(model),
        "overall_bytes": overall.nbytes,
        "overall_at": overall.at,
        "overall_holders": overall.holders,
        "iteration_bytes": [per_iteration[i].nbytes for i in range(args.iterations)],
        "steady_bytes": steady.nbytes,
        "steady_at": steady.at,
        "holders": steady.holders,
        "at_rest_bytes": trace.live_at_end(),
        "rss_growth_mib": max(first_peak, steady_peak) - baseline,
        "rss_steady_growth_mib": steady_peak - baseline,
        "rss_peak_mib": max(first_peak, steady_peak),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))


# ---------------------------------------------------------------------- speed worker (every setup, interleaved)
def speed_worker(args: argparse.Namespace) -> None:
    workload = WORKLOADS[args.workload]
    load = MachineLoad()
    load.start()
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [workload.make_batch(generator) for _ in range(4)]
    torch.manual_seed(0)
    base = workload.build()
    runs, optimizers, failed = [], {}, {}
    for name in args.setups:
        try:
            model, optimizer = zc.build(name, copy.deepcopy(base))
            step = train_step(model, optimizer, workload.loss, batches)
            step(0)  # a setup that cannot run on CPU/gloo fails here, on every rank alike
        except Exception as error:  # noqa: BLE001 - reported, with the traceback's last line
            failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:400]
            traceback.print_exc()
            dist.barrier()
            continue
        # Each block starts behind one untimed iteration and ends settled (its all-gathers waited for, untimed):
        # every timed iteration pays for one step's gathers, and none is left to run under another setup.
        run = Contender(name, step, lead=lambda step=step: step(0))
        run.rest = lambda optimizer=optimizer: (optimizer.settle(), optimizer.zero_grad(set_to_none=True))
        runs.append(run)
        optimizers[name] = optimizer
    del base
    samples = interleave(runs, args.rounds, args.iters, args.warmup)
    timed = args.rounds * args.iters
    step_ms = {name: statistics.median(o.step_s[-timed:]) * 1e3 for name, o in optimizers.items()}
    wire = {}
    if link.current() is not None:
        counter = zc.WireCounter()
        for run in runs:
            wire[run.name] = counter.count(run.step, optimizers[run.name].settle, args.wire_steps) / args.wire_steps
    kernel = {}
    for run in runs:
        cost = torch.tensor(zc.kernel_cost(run.step, optimizers[run.name].settle, args.wire_steps), dtype=torch.float64)
        dist.all_reduce(cost, op=dist.ReduceOp.MAX)
        kernel[run.name] = cost.tolist()
    load.stop()
    slowest = torch.tensor([step_ms[r.name] for r in runs], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    result = {
        "samples": samples,
        "step_ms": dict(zip([r.name for r in runs], slowest.tolist())),
        "wire": wire,
        "kernel": kernel,
        "failed": failed,
        "load": load.describe(),
    }
    runs.clear()
    gc.collect()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    if args.part == "memory":
        memory_worker(args)
    else:
        speed_worker(args)
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


# ---------------------------------------------------------------------- launcher
def run_world(world: int, args: argparse.Namespace, extra: list[str]) -> Any:
    """Run this study's worker on ``world`` ranks; what its rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [args.part, "--worker", "--out", str(out), *extra]
        env = launch.env(OMP_NUM_THREADS="1")
        module = launch.main_module()
        if args.per_rank_links:
            status = link.run_ranks(args.link, world, launch.python_m(module, argv), env)
        else:
            status = subprocess.run(launch.torchrun_m(module, argv, nproc=world), env=env).returncode
        if status != 0 or not out.exists():
            print(f"{world} ranks, {' '.join(extra)}: failed with status {status}", file=sys.stderr)
            return None
        return json.loads(out.read_text())


def memory_main(args: argparse.Namespace) -> Path:
    zc.counting_allocator()  # compiled once here, so that the ranks find it cached
    runs: dict[int, dict[str, Any]] = {}
    for world in args.world_sizes:
        runs[world] = {}
        for setup in args.setups:
            print(f"--- memory: {world} ranks, {setup}", flush=True)
            extra = ["--setup", setup, "--layers", str(args.layers), "--width", str(args.width)]
            extra += ["--iterations", str(args.iterations)] + (["--snapshot", *args.snapshot] if args.snapshot else [])
            result = run_world(world, args, extra)
            if result is not None:
                runs[world][setup] = result
    return write_memory_report(runs, args)


def speed_main(args: argparse.Namespace) -> Path:
    runs = {}
    for world in args.world_sizes:
        print(f"--- speed: {world} ranks, {args.workload}", flush=True)
        extra = ["--workload", args.workload, "--setups", *args.setups, "--rounds", str(args.rounds)]
        extra += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--wire-steps", str(args.wire_steps)]
        result = run_world(world, args, extra)
        if result is not None:
            runs[world] = result
    return write_speed_report(runs, args)


# ---------------------------------------------------------------------- reports
def report_file(kind: str, args: argparse.Namespace, suffix: str = "md") -> Path:
    """``results/YYYY-MM-DD-zero-KIND[-RATE][-per-rank][-LABEL].SUFFIX``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"{today()}-zero-{kind}"
    name += f"-{link.parse_rate(args.link)}" if args.link else ""
    name += "-per-rank" if args.per_rank_links else ""
    name += f"-{args.label}" if args.label else ""
    return RESULTS_DIR / f"{name}.{suffix}"


def source_fingerprint() -> str:
    """A hash of src/gradsync's Python files except elastic/ (what the setups run), as they are on disk."""
    root = Path(launch.REPO) / "src" / "gradsync"
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        if "elastic" not in path.relative_to(root).parts:
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def header(title: str, args: argparse.Namespace) -> list[str]:
    topology = link.describe(args.link, True) if args.per_rank_links else link.describe(args.link)
    changed = source_fingerprint() != args.started_at  # src/ was edited while the setups ran: numbers mix both
    return [
        f"# {title} ({today()})",
        "",
        f"Command: `{launch.command_line()}`",
        "",
        f"- torch {torch.__version__}, Python {sys.version.split()[0]}, commit {revision()}",
        *(
            ["- **src/gradsync (outside elastic/) changed during the run: the setups ran on different code**"]
            if changed
            else []
        ),  # fmt: skip
        f"- backend gloo on CPU, {os.cpu_count()} CPU cores, torch threads per rank 1; "
        f"world sizes {' '.join(map(str, args.world_sizes))}",
        f"- link: {topology if args.link else link.describe()}",
        "- every setup trains with AdamW (lr 1e-3, weight decay 0.01), fp32",
        *[f"- environment: `{k}={v}` (glibc malloc)" for k, v in os.environ.items() if k.startswith("MALLOC_")],
    ]


def worst(per_rank: list[dict[str, Any]], key: str) -> float:
    return max(r[key] for r in per_rank)


def write_memory_report(runs: dict[int, dict[str, Any]], args: argparse.Namespace) -> Path:
    png = report_file("memory", args, "png")
    done = [r[0]["params"] for world in runs.values() for r in world.values()]
    if not done:
        raise SystemExit("zero memory: no setup ran to the end; see the errors above")
    params = done[0]
    lines = header("ZeRO: peak memory per rank", args)
    lines += [
        f"- model: {args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.1f} M parameters "
        f"({params * 4 / MIB:.0f} MiB fp32), batch {BATCH}, MSE loss; {args.iterations} iterations: "
        "zero_grad(set_to_none=True), forward, backward, step",
        "- tracked = live bytes of torch's CPU allocator since before the model was built: every allocation and "
        "free, on every thread, logged by a counting wrapper around the allocator and replayed, so the peak is exact "
        "([Note: model-state memory] in lib/zero_contenders.py); 'steady' = the highest peak of iterations 2.., "
        "after the bucket rebuild at iteration 1; 'at rest' = live after the last step",
        "- RSS: high-water mark (VmHWM) over the RSS before building the model (lib/rss.py's reset); "
        "every number is the maximum over ranks",
        "",
        "Setups:",
        "",
        *[f"- `{name}`: {zc.DESCRIPTIONS[name]}" for name in args.setups],
        "",
        f"![memory per rank]({png.name})",
        "",
        "## Peak memory per rank",
        "",
        "| setup | ranks | tracked peak MiB, all iterations | steady peak MiB | steady bytes / parameter "
        "| analytic bytes / parameter | steady / analytic | at rest MiB | peak RSS MiB | RSS growth MiB "
        "| RSS growth MiB, iterations 2.. |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup in args.setups:
        for world, results in runs.items():
            ranks = results.get(setup)
            if ranks is None:
                lines.append(f"| {setup} | {world} | failed | | | | | | | | |")
                continue
            steady = worst(ranks, "steady_bytes")
            expected = zc.analytic_bytes(setup, world, params, ranks[0]["buckets"])
            ratio = f"{steady / expected:.3f}" if expected else "-"
            analytic = f"{expected / params:.2f}" if expected else "-"
            lines.append(
                f"| {setup} | {world} | {worst(ranks, 'overall_bytes') / MIB:.0f} | {steady / MIB:.0f} "
                f"| {steady / params:.2f} | {analytic} | {ratio} | {worst(ranks, 'at_rest_bytes') / MIB:.0f} "
                f"| {worst(ranks, 'rss_peak_mib'):.0f} | {worst(ranks, 'rss_growth_mib'):.0f} "
                f"| {worst(ranks, 'rss_steady_growth_mib'):.0f} |"
            )
    lines += ["", "Analytic lines (bytes per parameter, N ranks):", ""]
    lines += [f"- `{name}`: {text}" for name, (text, _, _) in zc.ANALYTIC.items() if name in args.setups]
    lines += ["", "## Against the targets (steady peak of torch allocations, within 5%)", ""]
    lines += memory_target_lines(runs, params)
    several = [w for w in runs if w > 1]
    shown = sorted({min(several), max(several)}) if several else list(runs)  # the smallest and largest group
    lines += ["", f"## What holds the memory at the steady peak ({', '.join(map(str, shown))} ranks)", ""]
    for world in shown:
        for setup, ranks in runs[world].items():
            lines += holder_lines(setup, world, ranks[0])
    lines += ["## The peak of the first iterations, where it is higher (the relayout after the bucket rebuild)", ""]
    for world in shown:
        for setup, ranks in runs[world].items():
            if ranks[0]["overall_bytes"] > 1.05 * ranks[0]["steady_bytes"]:
                lines += holder_lines(setup, world, ranks[0], "overall")
    write_memory_chart(runs, args, params, png)
    path = report_file("memory", args)
    path.write_text("\n".join(lines) + "\n")
    return path


def memory_target_lines(runs: dict[int, dict[str, Any]], params: int) -> list[str]:
    lines = []
    for setup, formula in (("zero2_view", "(4 + 12/N) P + two buckets"), ("zero2", "(4 + 12/N) P + two buckets"),
                           ("zero1_view", "(8 + 8/N) P")):  # fmt: skip
        for world, results in runs.items():
            ranks = results.get(setup)
            if ranks is None:
                continue
            steady = worst(ranks, "steady_bytes")
            target = zc.analytic_bytes(setup, world, params, ranks[0]["buckets"]) or 0
            verdict = "holds" if steady <= 1.05 * target else f"misses by {steady / target - 1:.0%}"
            lines.append(
                f"- `{setup}`, {world} ranks: {steady / MIB:.0f} MiB against {formula} = {target / MIB:.0f} MiB: "
                f"{steady / target:.3f}, {verdict} ({(steady - target) / MIB:+.0f} MiB)"
            )
    return lines


def holder_lines(setup: str, world: int, rank0: dict[str, Any], which: str = "steady", top: int = 8) -> list[str]:
    """What held the bytes at rank 0's ``which`` peak (``steady`` or ``overall``), the biggest ``top`` first."""
    holders = sorted(rank0["holders" if which == "steady" else "overall_holders"].items(), key=lambda kv: -kv[1])
    total, at = rank0[f"{which}_bytes"], rank0[f"{which}_at"]
    lines = [
        f"`{setup}`, {world} ranks (rank 0), {which} peak: {total / MIB:.0f} MiB, reached at `{at}`",
        "",
        "| allocated in (iteration phase / label or gradsync frame / aten op) | MiB | share |",
        "|---|---:|---:|",
    ]
    for name, nbytes in holders[:top]:
        lines.append(f"| `{name}` | {nbytes / MIB:.1f} | {nbytes / total:.1%} |")
    rest = sum(n for _, n in holders[top:])
    if rest:
        lines.append(f"| {len(holders) - top} others | {rest / MIB:.1f} | {rest / total:.1%} |")
    return [*lines, ""]


def write_memory_chart(runs: dict[int, dict[str, Any]], args: argparse.Namespace, params: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    worlds = list(runs)
    for k, setup in enumerate(args.setups):
        color = f"C{k}"
        shown = [w for w in worlds if setup in runs[w]]
        if not shown:
            continue
        tracked = [worst(runs[w][setup], "steady_bytes") / 2**30 for w in shown]
        grown = [worst(runs[w][setup], "rss_growth_mib") / 1024 for w in shown]
        left.plot(shown, tracked, "-o", color=color, label=setup)
        right.plot(shown, grown, "-o", color=color, label=setup)
        expected = [zc.analytic_bytes(setup, w, params, runs[w][setup][0]["buckets"]) for w in shown]
        if all(e is not None for e in expected):
            for ax in (left, right):
                ax.plot(shown, [e / 2**30 for e in expected], "--", color=color, alpha=0.6)
    for ax, title in (
        (left, "steady peak of torch allocations per rank"),
        (right, "peak RSS growth per rank (all iterations)"),
    ):
        ax.set_xticks(worlds)
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("GiB per rank")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(
        f"ZeRO memory, {params / 1e6:.0f} M parameters, fp32 AdamW; dashed: analytic (docs/zero.md) ({today()})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_cell(samples: dict[str, list[float]], name: str, reference: str, iters: int) -> str:
    if name not in samples or reference not in samples or name == reference:
        return "-"
    ratio, low, high = paired_ratio(samples[name], samples[reference], iters)
    return f"{ratio:.3f} [{low:.3f}, {high:.3f}]"


def write_speed_report(runs: dict[int, dict[str, Any]], args: argparse.Namespace) -> Path:
    workload = WORKLOADS[args.workload]
    tensors, params, nbytes = gradient_size(workload)
    lines = header(f"ZeRO: speed and bytes on the wire, {args.workload}", args)
    lines += [
        f"- workload `{args.workload}`: {workload.description} (here with AdamW, as every setup); {tensors} tensors, "
        f"{params / 1e6:.2f} M parameters, {nbytes / MIB:.1f} MiB of fp32 gradients",
        f"- {args.warmup} warm-up iterations per setup (bucket rebuild included), then {args.rounds} rounds x "
        f"{args.iters} iterations, interleaved; time = slowest rank's; ratios per round with a 90% bootstrap "
        "interval (lib/common.py's `paired_ratio`)",
        "- `step()` = median time of `optimizer.step()` alone (slowest rank): the AdamW update, plus for the "
        "sharded setups what the step waits for (the all-gathers without overlap; ZeroRedundancyOptimizer's "
        "broadcasts)",
        (
            f"- bytes: counted on the namespace's devices ([Note: bytes on the wire]) around {args.wire_steps} steps "
            "per setup after the timing, all ranks' sends together, minus the bare module's count (barriers, store); "
            "`ring` = what one ring all-reduce of the gradients sends, 2 (N - 1) x gradient bytes"
            if args.link
            else "- bytes: not counted (plain loopback is shared with the rest of the machine; give --link RATE)"
        ),
        f"- page faults and system CPU: minor faults and kernel CPU time of one rank's process (all its threads) per "
        f"step, over {args.wire_steps} more steps per setup, the worst rank's (`zero_contenders.kernel_cost`)",
        *[f"- machine load, {world} ranks: {run['load']}" for world, run in runs.items()],
        "",
        "Setups:",
        "",
        *[f"- `{name}`: {zc.DESCRIPTIONS[name]}" for name in args.setups],
    ]
    for world, run in runs.items():
        lines += ["", f"## {world} ranks", "", *speed_table(run, args, world, nbytes)]
        lines += [f"- `{name}` did not run: `{error}`" for name, error in run["failed"].items()]
    if args.link:
        lines += ["", "## Against the targets", "", *target_lines(runs, args)]
    lines += ["", "## The optimizer step, split N ways", "", *step_lines(runs)]
    path = report_file(f"speed-{args.workload}", args)
    path.write_text("\n".join(lines) + "\n")
    return path


def speed_table(run: dict[str, Any], args: argparse.Namespace, world: int, nbytes: int) -> list[str]:
    samples, wire = run["samples"], run["wire"]
    floor = wire.get("no_comm", 0.0)
    lines = [
        "| setup | median ms | p90 ms | vs gradsync_ddp [90% CI] | vs torch_zero [90% CI] | step() ms "
        "| MB on the wire / step | bytes vs gradsync_ddp | bytes vs ring | page faults / step | system CPU ms / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ring = 2 * (world - 1) * nbytes
    for name, times in samples.items():
        s = summarise(times)
        sent = wire.get(name)
        wire_cells = "- | - | -"
        if sent is not None and name != "no_comm":
            reference = wire.get(REFERENCE, 0.0) - floor
            vs_ref = f"{(sent - floor) / reference:.4f}" if reference > 0 else "-"
            wire_cells = f"{(sent - floor) / 1e6:.2f} | {vs_ref} | {(sent - floor) / ring:.4f}"
        lines.append(
            f"| {name} | {s.median_ms:.1f} | {s.p90_ms:.1f} | {ratio_cell(samples, name, REFERENCE, args.iters)} "
            f"| {ratio_cell(samples, name, ZERO_TORCH, args.iters)} | {run['step_ms'].get(name, 0.0):.1f} "
            f"| {wire_cells} | {kernel_cells(run.get('kernel', {}).get(name))} |"
        )
    return lines


def kernel_cells(cost: list[float] | None) -> str:
    return "- | -" if cost is None else f"{cost[0]:,.0f} | {cost[1]:.1f}"


def verdict(ratio: float, low: float, high: float, target: float) -> str:
    if high <= target:
        return "holds"
    if low <= target:
        return f"not distinguishable from {target:.2f}"
    return "misses"


STEP_HOLDS = {
    "zero2": "the shard's update alone; the all-gathers overlap the next forward",
    "zero1": "the shard's update alone; the all-gathers overlap the next forward",
    "zero2_no_overlap": "the shard's update and the parameters' all-gathers",
    "zero2_backward": "nothing but bookkeeping (the update ran in backward; the gathers overlap the forward)",
    "zero2_backward_no_overlap": "the wait for the last buckets' all-gathers (the update ran in backward)",
    "torch_zero": "the shard's update and the owners' broadcasts",
    "fsdp2": "the update of the local DTensor shards",
}


def step_lines(runs: dict[int, dict[str, Any]]) -> list[str]:
    """Each sharded setup's ``step()`` over gradsync DDP's (same AdamW): the update runs on 1/N of the elements."""
    lines = []
    for world, run in runs.items():
        steps = run["step_ms"]
        if REFERENCE not in steps:
            continue
        for name, holds in STEP_HOLDS.items():
            if name in steps:
                lines.append(
                    f"- {world} ranks: `{name}` step() {steps[name]:.1f} ms = {steps[name] / steps[REFERENCE]:.2f}x "
                    f"`{REFERENCE}`'s {steps[REFERENCE]:.1f} ms (1/N = {1 / world:.2f}); it holds {holds}"
                )
    return lines


def target_lines(runs: dict[int, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    for world, run in runs.items():
        samples, wire = run["samples"], run["wire"]
        for name in SHARDED_2:
            if name not in samples:
                continue
            for reference, target in ((REFERENCE, 1.00), (ZERO_TORCH, 0.75)):
                if reference not in samples:
                    continue
                ratio, low, high = paired_ratio(samples[name], samples[reference], args.iters)
                lines.append(
                    f"- {world} ranks, `{name}` / `{reference}` <= {target:.2f}: {ratio:.3f} [{low:.3f}, {high:.3f}], "
                    f"{verdict(ratio, low, high, target)}"
                )
        floor, reference = wire.get("no_comm", 0.0), wire.get(REFERENCE)
        for name in (*SHARDED_2, "zero1"):
            if name in wire and reference:
                share = (wire[name] - floor) / (reference - floor)
                lines.append(
                    f"- {world} ranks, bytes of `{name}` / `{REFERENCE}` <= 1.05: {share:.4f}, "
                    f"{'holds' if share <= 1.05 else 'misses'}"
                )
    return lines


# ---------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["memory", "speed"])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None, help="memory: 1 2 3 4; speed: 2")
    parser.add_argument("--setups", nargs="+", choices=list(zc.DESCRIPTIONS), default=None)
    parser.add_argument("--label", help="a suffix for the report's name")
    parser.add_argument("--link", help="rate of a shaped link (1gbit, ...): the study runs inside it (lib/link.py)")
    parser.add_argument("--per-rank-links", action="store_true", help="speed, with --link: one link per rank")
    memory = parser.add_argument_group("memory")
    memory.add_argument("--layers", type=int, default=96)
    memory.add_argument("--width", type=int, default=1024)
    memory.add_argument("--iterations", type=int, default=4)
    memory.add_argument(
        "--snapshot", nargs="+", choices=list(zc.DESCRIPTIONS), help="record Python frames for these setups"
    )
    speed = parser.add_argument_group("speed")
    speed.add_argument("--workload", choices=list(WORKLOADS), default="transformer")
    speed.add_argument("--rounds", type=int, default=8)
    speed.add_argument("--iters", type=int, default=4, help="iterations per setup per round")
    speed.add_argument("--warmup", type=int, default=3)
    speed.add_argument("--wire-steps", type=int, default=3, help="steps per setup whose bytes are counted")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.per_rank_links and not args.link:
        parser.error("--per-rank-links needs --link RATE")
    if args.part == "memory" and args.per_rank_links:
        parser.error("memory runs on the shared loopback, shaped or not; drop --per-rank-links")
    if args.world_sizes is None:
        args.world_sizes = [1, 2, 3, 4] if args.part == "memory" else [2]
    if args.setups is None:
        args.setups = MEMORY_SETUPS if args.part == "memory" else SPEED_SETUPS
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    link.enter_launcher(args.link, args.per_rank_links)  # with --link: reruns this launcher inside a namespace
    args.started_at = source_fingerprint()
    path = memory_main(args) if args.part == "memory" else speed_main(args)
    print(path.read_text())
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
