"""Before/after: this working tree's gradsync against a git revision's, interleaved in one run.

Run from the repository root (a few minutes; ``--before`` defaults to ``HEAD``):

    python -m benchmarks ab --before HEAD --label fused-division --workloads large_grad transformer

    python -m benchmarks ab --link 1gbit --hook powersgd --before fe753b1 --label powersgd --workloads transformer

The first is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.ab
--before HEAD ...``; with ``--link`` it is ``python -m benchmarks.studies.ab --link 1gbit ...``, which
starts torchrun inside the namespace itself.

``--hook powersgd`` registers each package's own ``powersgd_hook`` (rank ``--rank``, compressing
from iteration 2) on ``after`` and ``before``, and torch's ``powerSGD_hook`` on torch's DDP (with
one bucket: with several it deadlocks on gloo, see studies/hooks.py). ``--link RATE`` runs it all
on a shaped link (lib/link.py).

Each rank extracts ``src/gradsync`` of the ``--before`` revision (``git archive``) into a
temporary directory as the package ``gradsync_before`` and imports it next to the working
tree's ``gradsync``. Contenders, on the same weights and batches, interleaved in rounds
(lib/common.py's ``interleave``): ``after`` (working tree), ``before`` (the revision), torch's DDP
with the same ``gradient_as_bucket_view`` and the bare module. The key number is the
per-round ratio after/before with its bootstrap interval (lib/common.py's ``paired_ratio``): both
ran in the same rounds, so drift on the machine cancels. Rank 0 writes
``benchmarks/results/YYYY-MM-DD-ab-LABEL.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import gradsync.hooks as after_hooks
from benchmarks.lib import launch, link, shapes
from benchmarks.lib.common import (
    REPO,
    TORCH_DDP,
    Contender,
    environment_lines,
    interleave,
    paired_ratio,
    report_path,
    summarise,
    train_step,
)
from benchmarks.lib.workloads import WORKLOADS, Workload
from gradsync import DistributedDataParallel as AfterDDP

SHAPES = {shape.name: shape for shape in shapes.GRID}

CONTENDERS = ("after", "before", "torch_ddp", "no_comm")
BATCHES_PER_RANK = 4


def import_revision(revision: str, into: Path) -> Any:
    """``src/gradsync`` at ``revision``, importable as ``gradsync_before``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision, "src/gradsync"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "gradsync").rename(into / "gradsync_before")
    sys.path.insert(0, str(into))
    return importlib.import_module("gradsync_before")


def build(name: str, module: nn.Module, before: Any, args: argparse.Namespace) -> nn.Module:
    as_view = args.as_view
    if name == "after":
        return _with_hook(AfterDDP(module, gradient_as_bucket_view=as_view), after_hooks, args)
    if name == "before":
        ddp = before.DistributedDataParallel(module, gradient_as_bucket_view=as_view)
        return _with_hook(ddp, importlib.import_module("gradsync_before.hooks"), args)
    if name == "torch_ddp":
        if args.hook == "powersgd":  # one bucket: torch's hook deadlocks on gloo with several
            ddp = TORCH_DDP(module, gradient_as_bucket_view=as_view, bucket_cap_mb=1024)
            state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
            return ddp
        return TORCH_DDP(module, gradient_as_bucket_view=as_view)
    return module


def _with_hook(ddp: nn.Module, hooks: Any, args: argparse.Namespace) -> nn.Module:
    if args.hook == "powersgd":
        state = hooks.PowerSGDState(None, matrix_approximation_rank=args.rank, start_iter=2)
        ddp.register_comm_hook(state, hooks.powersgd_hook)
    return ddp


def measure(workload: Workload, before: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [workload.make_batch(generator) for _ in range(BATCHES_PER_RANK)]
    torch.manual_seed(0)
    base = workload.build()
    iters = args.iters or workload.iters

    def build_runs(names: list[str]) -> list[Contender]:
        runs = []
        for name in names:
            model = build(name, copy.deepcopy(base), before, args)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=workload.momentum)
            contender = Contender(name, train_step(model, optimizer, workload.loss, batches))
            contender.rest = lambda optimizer=optimizer: optimizer.zero_grad(set_to_none=True)
            runs.append(contender)
        return runs

    if not args.fresh_per_round:
        runs = build_runs(list(CONTENDERS))
        samples = interleave(runs, args.rounds, iters, args.warmup)
        runs.clear()
        gc.collect()
        return samples
    # [Note: fresh contenders per round] Where each model and its buffers land in memory can
    # favour one contender for a whole run; rebuilding all of them every round, in rotating
    # order, turns that luck into round-to-round noise that the per-round ratios average out.
    samples = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        names = list(CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)])
        runs = build_runs(names)
        for name, times in interleave(runs, 1, iters, args.warmup).items():
            samples[name] += times
        runs.clear()
        gc.collect()
    return samples


def report(results: dict[str, dict[str, list[float]]], iters: dict[str, int], args: argparse.Namespace) -> str:
    lines = [
        f"# A/B: gradsync working tree vs `{args.before}` ({args.label})",
        "",
        *environment_lines(launch.command_line()),
        f"- `--before {args.before}`: {revision_line(args.before)}",
        f"- comm hook: {_hook_line(args)}",
        f"- gradient_as_bucket_view={args.as_view}; {args.rounds} rounds, warm-up {args.warmup}"
        f"{', contenders rebuilt every round' if args.fresh_per_round else ''}; iteration as in "
        "common.py (zero_grad(set_to_none=True), forward, loss, backward, SGD step), slowest rank",
        "",
        "| workload | contender | median ms | p90 ms | per-round ratio to `before` [90% CI] "
        "| per-round ratio to torch_ddp [90% CI] |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload, samples in results.items():
        for name in CONTENDERS:
            s = summarise(samples[name])
            cells = []
            for reference in ("before", "torch_ddp"):
                ratio, low, high = paired_ratio(samples[name], samples[reference], iters[workload])
                cells.append(f"{ratio:.3f} [{low:.3f}, {high:.3f}]")
            lines.append(f"| {workload} | {name} | {s.median_ms:.2f} | {s.p90_ms:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _hook_line(args: argparse.Namespace) -> str:
    if args.hook == "none":
        return "none (each DDP's default all-reduce)"
    return (
        f"PowerSGD rank {args.rank} from iteration 2: each package's own `powersgd_hook` on `after` and `before` "
        "(default buckets), torch's `powerSGD_hook` on torch_ddp with one bucket"
    )


def revision_line(revision: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h %s", revision], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="HEAD", help="git revision to compare against")
    parser.add_argument("--label", default="change", help="report file suffix")
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=[*WORKLOADS, *SHAPES],
        default=list(WORKLOADS),
        help="the suite's workloads, or the sweep's shapes by name (lib/shapes.py)",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=None, help="iterations per block (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--as-view", action="store_true", help="gradient_as_bucket_view=True for all DDPs")
    parser.add_argument(
        "--fresh-per-round",
        action="store_true",
        help="rebuild every contender each round ([Note: fresh contenders per round])",
    )
    parser.add_argument("--hook", choices=["none", "powersgd"], default="none", help="comm hook on every DDP")
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's matrix_approximation_rank with --hook")
    parser.add_argument("--link", help="rate of a shaped loopback link (1gbit, ...): start with python (lib/link.py)")
    args = parser.parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        before = import_revision(args.before, Path(tmp))
        results = {}
        iters = {}
        for name in args.workloads:
            workload = WORKLOADS[name] if name in WORKLOADS else shapes.workload(SHAPES[name])
            iters[name] = args.iters or workload.iters
            results[name] = measure(workload, before, args)
            if dist.get_rank() == 0:
                print(f"{name}: done", flush=True)
    if dist.get_rank() == 0:
        path = report_path(f"ab-{args.label}")
        path.write_text(report(results, iters, args))
        print(f"report: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
