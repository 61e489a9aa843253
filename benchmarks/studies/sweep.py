"""The sweep: gradsync's and torch's defaults and hooks against the bound on 27 generated model shapes.

Run from the repository root (about 20 minutes at 1 Gbit/s on 2 cores):

    python -m benchmarks sweep --link 1gbit     # a shaped link (root; lib/link.py)
    python -m benchmarks sweep --link 10gbit
    python -m benchmarks sweep                  # plain loopback

The last is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.sweep``;
with ``--link`` it is ``python -m benchmarks.studies.sweep --link 1gbit``, which starts torchrun
inside the namespace itself.

The shapes (``lib/shapes.py``'s ``GRID``): GPT-like decoders (1, 2, 4 sequences of 128, vocabulary
2k-32k, width 128-512, 2-8 layers, tied and untied head), MLPs of many small and of few large layers,
and the BatchNorm conv net, spanning compute per gradient byte over two orders of magnitude. Per
shape, interleaved over rounds (lib/common.py's [Note: how an iteration is timed]): no
communication, the bound's parts (``forward_only`` and ``raw_allreduce``, the suite's, plus
``to_first_gradient``), torch's DDP and gradsync at their defaults, ``bucket_cap_mb="auto"``, gradsync's
PowerSGD at ranks 1 and 4 and torch's ``powerSGD_hook`` at the same ranks, gradsync's int8 hook
(``lib/contenders.py``). Each shape is short (``--warmup 3 --rounds 5 --iters 2``); the ratios are
per-round paired ratios with 90% bootstrap intervals (lib/sweep_stats.py). Rank 0 writes
``benchmarks/results/YYYY-MM-DD-sweep[-RATE].md`` and ``.png`` (ratio to the bound and to no
communication, against compute per byte), with issue #46's targets evaluated on the same run.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.lib import launch, link, shapes, sweep_report
from benchmarks.lib.common import MachineLoad, interleave
from benchmarks.lib.workloads import gradient_size
from benchmarks.studies import suite

CONTENDERS = sweep_report.CONTENDERS


def gradsync_timing(run: Any) -> tuple[int, float, float]:
    stats = run.model.stats()
    return stats.iterations, stats.avg_comm_s * stats.iterations, stats.avg_exposed_comm_s * stats.iterations


def measure(shape: shapes.Shape, args: Any) -> sweep_report.ShapeResult:
    workload = shapes.workload(shape, args.iters, args.rounds)
    tensors, params, nbytes = gradient_size(workload)
    batches = suite.make_batches(workload)
    torch.manual_seed(0)  # same weights on every rank and for every contender
    base = workload.build()
    runs = [suite.make_contender(name, workload, base, batches, None) for name in CONTENDERS]
    runs += [suite.raw_allreduce(nbytes), suite.forward_only(workload, base, batches)]
    runs.append(suite.to_first_gradient(workload, base, batches))
    ours = runs[CONTENDERS.index("gradsync")]
    before: list[tuple[int, float, float]] = []
    during = MachineLoad()
    during.start()
    samples = interleave(
        runs, args.rounds, args.iters, args.warmup, after_warmup=lambda: before.append(gradsync_timing(ours))
    )
    during.stop()
    n, comm, exposed = (a - b for a, b in zip(gradsync_timing(ours), before[0]))
    per_iter = torch.tensor([comm / n, exposed / n], dtype=torch.float64)
    dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)
    buckets = len(ours.model.stats().buckets)  # type: ignore[attr-defined]
    runs.clear()  # both DDPs hold reference cycles: free them while the process group lives
    gc.collect()
    return sweep_report.ShapeResult(
        shape.name,
        shape.describe(),
        tensors,
        params,
        nbytes,
        args.iters,
        samples,
        buckets,
        per_iter[0].item(),
        per_iter[1].item(),
        during.other_cores(),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [s.name for s in shapes.GRID]
    parser.add_argument("--shapes", nargs="+", choices=names, default=names)
    parser.add_argument("--warmup", type=int, default=3, help="iterations per contender before timing (>= 3)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="iterations per contender per round")
    parser.add_argument("--label", default="", help="appended to the report's name: sweep-LABEL[-RATE].md")
    parser.add_argument(
        "--link",
        help="rate of a shaped loopback link (1gbit, 10gbit, ...): start with python, not torchrun (see lib/link.py)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    if args.warmup < 3:
        raise SystemExit("--warmup must be at least 3: PowerSGD compresses from iteration 2 on")
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    load = MachineLoad()
    load.start()
    results = []
    for shape in (s for s in shapes.GRID if s.name in args.shapes):
        start = time.perf_counter()
        results.append(measure(shape, args))
        if dist.get_rank() == 0:
            print(f"{shape.name}: measured in {time.perf_counter() - start:.1f} s", flush=True)
    load.stop()
    if dist.get_rank() == 0:
        path = sweep_report.write(results, load, args, launch.command_line())
        print(path.read_text())
        print(f"report: {path}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
