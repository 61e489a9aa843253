"""Communication hooks on a communication-bound model: bytes on the wire and iteration time.

Run from the repository root (about 3 minutes on a 2-core machine; wait until the machine is
otherwise idle):

    python -m benchmarks hooks
    python -m benchmarks hooks --link 1gbit --workload transformer   # network-bound (root; lib/link.py)

The first is exactly ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.hooks``;
with ``--link`` it is ``python -m benchmarks.studies.hooks --link 1gbit ...``, which starts
torchrun inside the namespace itself.

The model is ``large_grad`` from ``lib/workloads.py`` (~50 M parameters, batch 4: little
compute, 200 MiB of gradients). Hooks are compared in groups, each group's contenders
interleaved over rounds (lib/common.py's [Note: how an iteration is timed]) with the
no-communication step (the floor every ratio is taken to, measured in the same rounds) and
freed before the next group, so at most four model copies live at once:

- gradsync ``allreduce_hook`` vs torch DDP default;
- gradsync ``fp16_compress_hook`` vs torch DDP + torch's ``fp16_compress_hook``;
- gradsync ``bf16_compress_hook`` (torch's refuses to register on CPU/gloo);
- gradsync ``powersgd_hook`` vs torch's ``powerSGD_hook``, rank 1 and rank 4, both
  compressing from iteration 2; torch's only with one bucket, since with several it
  deadlocks on gloo (see ``powersgd_group``);
- gradsync ``topk_hook`` (ratio 0.01) and ``int8_hook`` (torch's quantization hooks fail
  on gloo).

Bytes on the wire per rank and iteration: gradsync's hooks count them (``state.wire``,
ring-algorithm bytes, see ``gradsync/hooks/wire.py``); for torch's hooks the same count is
computed from the parameter shapes. Whether torch's bf16 and quantization hooks run is
probed first, on a tiny model, and what they raise is quoted in the report.
Rank 0 writes ``benchmarks/results/YYYY-MM-DD-hooks.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

from benchmarks.lib import launch, link
from benchmarks.lib.common import (
    TORCH_DDP,
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
)
from benchmarks.lib.workloads import WORKLOADS
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import hooks

WORKLOAD = WORKLOADS["large_grad"]  # --workload replaces it (transformer on a shaped link)
ONE_BUCKET_MB = 1024  # above the model's 192 MiB of gradients: every parameter in one bucket


@dataclass
class Setup:
    """One contender: how to wrap the module, and how many bytes it sends per iteration."""

    name: str
    wrap: Callable[[nn.Module], tuple[nn.Module, Any]]  # -> (model, hook state or None)
    wire: Callable[[Any, nn.Module, int], float]  # (state, module, timed iterations) -> bytes


# ---------------------------------------------------------------------- bytes on the wire
def ring_all_reduce_bytes(nbytes: float, world: int) -> float:
    return 2 * (world - 1) / world * nbytes


def dense_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def torch_powersgd_elements(module: nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """Elements torch's powerSGD_hook all-reduces per iteration once compressing (P, Q, the rest)."""
    total = 0
    for p in module.parameters():
        if p.dim() < 2:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else p.numel()
    return total


def measured(state: Any, module: nn.Module, timed: int) -> float:
    return state.wire.mean_bytes_per_iteration(last=timed)


def analytic(factor: float) -> Callable[[Any, nn.Module, int], float]:
    return lambda state, module, timed: ring_all_reduce_bytes(factor * dense_bytes(module), dist.get_world_size())


def analytic_powersgd(rank: int) -> Callable[[Any, nn.Module, int], float]:
    return lambda state, module, timed: ring_all_reduce_bytes(
        4 * torch_powersgd_elements(module, rank), dist.get_world_size()
    )


# ---------------------------------------------------------------------- contenders
def gradsync_with(make_state: Callable[[], Any], hook: Callable[..., Any], **ddp_args: Any) -> Any:
    def wrap(module: nn.Module) -> tuple[nn.Module, Any]:
        ddp, state = GradsyncDDP(module, **ddp_args), make_state()
        ddp.register_comm_hook(state, hook)
        return ddp, state

    return wrap


def torch_with(make_state: Callable[[], Any] | None, hook: Callable[..., Any] | None, **ddp_args: Any) -> Any:
    def wrap(module: nn.Module) -> tuple[nn.Module, Any]:
        ddp = TORCH_DDP(module, **ddp_args)
        state = make_state() if make_state else None
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        return ddp, state

    return wrap


def powersgd_group(rank: int) -> list[Setup]:
    """[Note: torch's PowerSGD on gloo] torch's powerSGD_hook issues its P and Q all-reduces
    from future callbacks, which gloo runs on its worker threads as collectives finish; with
    several buckets the ranks then issue them in different orders and deadlock (here: at
    the first compressing iteration, every time). With a single bucket the chain is
    sequential and it runs, so torch's hook is measured with one bucket, and gradsync's
    both with one bucket (like for like) and with its default buckets."""

    def gradsync_state() -> Any:
        return hooks.PowerSGDState(None, matrix_approximation_rank=rank, start_iter=2)

    def torch_state() -> Any:
        return powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)

    return [
        Setup(f"gradsync powersgd_hook r={rank}", gradsync_with(gradsync_state, hooks.powersgd_hook), measured),
        Setup(
            f"gradsync powersgd_hook r={rank}, one bucket",
            gradsync_with(gradsync_state, hooks.powersgd_hook, bucket_cap_mb=ONE_BUCKET_MB),
            measured,
        ),
        Setup(
            f"torch DDP + powerSGD_hook r={rank}, one bucket",
            torch_with(torch_state, powerSGD_hook.powerSGD_hook, bucket_cap_mb=ONE_BUCKET_MB),
            analytic_powersgd(rank),
        ),
    ]


NO_COMM = Setup("no communication", lambda module: (module, None), lambda state, module, timed: 0.0)

GROUPS: dict[str, list[Setup]] = {
    "plain": [
        Setup(
            "gradsync allreduce_hook", gradsync_with(lambda: hooks.AllReduceState(None), hooks.allreduce_hook), measured
        ),
        Setup("torch DDP default", torch_with(None, None), analytic(1.0)),
        NO_COMM,
    ],
    "fp16": [
        Setup(
            "gradsync fp16_compress_hook",
            gradsync_with(lambda: hooks.AllReduceState(None), hooks.fp16_compress_hook),
            measured,
        ),
        Setup(
            "torch DDP + fp16_compress_hook", torch_with(lambda: None, default_hooks.fp16_compress_hook), analytic(0.5)
        ),
    ],
    "bf16": [
        Setup(
            "gradsync bf16_compress_hook",
            gradsync_with(lambda: hooks.AllReduceState(None), hooks.bf16_compress_hook),
            measured,
        ),
    ],
    "powersgd r=1": powersgd_group(1),
    "powersgd r=4": powersgd_group(4),
    "topk": [
        Setup(
            "gradsync topk_hook ratio=0.01",
            gradsync_with(lambda: hooks.TopKState(None, ratio=0.01), hooks.topk_hook),
            measured,
        )
    ],
    "int8": [Setup("gradsync int8_hook", gradsync_with(lambda: hooks.Int8State(None), hooks.int8_hook), measured)],
}
TORCH_PROBES = {  # torch hooks expected not to work on CPU/gloo
    "torch DDP + bf16_compress_hook": default_hooks.bf16_compress_hook,
    "torch DDP + quantization_pertensor_hook": quantization_hooks.quantization_pertensor_hook,
    "torch DDP + quantization_perchannel_hook": quantization_hooks.quantization_perchannel_hook,
}


def probe(hook: Callable[..., Any]) -> str:
    """Register ``hook`` on torch's DDP around a tiny model and run 3 iterations; what happened."""
    torch.manual_seed(0)
    ddp = TORCH_DDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
    try:
        ddp.register_comm_hook(None, hook)
        for _ in range(3):
            ddp(torch.randn(4, 64)).sum().backward()
    except Exception as error:  # noqa: BLE001 - quoted in the report
        # torch nests the callback's error in two "Got the following error ..." wrappers: keep the innermost.
        message = str(error).strip().splitlines()[0].split("running the callback: ")[-1].replace("`", "'")
        return f"fails: `{type(error).__name__}: {message[:160]}`"
    finally:
        dist.barrier()
    return "runs"


# ---------------------------------------------------------------------- measurement
@dataclass
class Row:
    group: str
    name: str
    samples: list[float]
    wire_bytes: float


def measure_group(group: str, setups: list[Setup], base: nn.Module, batches: list[Any], args: Any) -> list[Row]:
    """Interleave the group's contenders and the no-communication step (the floor every ratio is taken to)."""
    setups = setups if NO_COMM in setups else [*setups, NO_COMM]
    runs, states, modules = [], [], []
    for setup in setups:
        module = copy.deepcopy(base)
        model, state = setup.wrap(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=WORKLOAD.momentum)
        run = Contender(setup.name, train_step(model, optimizer, WORKLOAD.loss, batches))
        run.rest = lambda optimizer=optimizer: optimizer.zero_grad(set_to_none=True)
        runs.append(run)
        states.append(state)
        modules.append(module)
    samples = interleave(runs, args.rounds, args.iters, args.warmup)
    timed = args.rounds * args.iters
    rows = [Row(group, s.name, samples[s.name], s.wire(st, m, timed)) for s, st, m in zip(setups, states, modules)]
    runs.clear()
    gc.collect()
    return rows


# ---------------------------------------------------------------------- report
def table(rows: list[Row], probes: dict[str, str], nbytes: int, iters: int) -> list[str]:
    """One line per contender; the last two columns are same-group paired ratios (see ``paired_ratio``)."""
    fp32 = ring_all_reduce_bytes(nbytes, dist.get_world_size())
    plain = [r.samples for r in rows if r.name == "torch DDP default"]
    reference = summarise(plain[0]).median_ms if plain else float("nan")
    floor = {r.group: r.samples for r in rows if r.name == NO_COMM.name}
    torch_hook = {r.group: r for r in rows if r.name.startswith("torch DDP +")}
    lines = [
        "| group | contender | MB on the wire / iteration | vs fp32 all-reduce | median ms | p90 ms "
        "| median / torch DDP default | vs no communication, same rounds [90% CI] "
        "| vs torch's hook, same rounds [90% CI] | bytes from |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        s = summarise(row.samples)
        source = "`state.wire`" if row.name.startswith("gradsync") else "computed"
        if row.name == NO_COMM.name:
            source = "-"
        to_floor = "-" if row.name == NO_COMM.name else _ratio(row.samples, floor[row.group], iters)
        rival = torch_hook.get(row.group)
        compare = rival is not None and rival is not row and row.name != NO_COMM.name
        to_torch = _ratio(row.samples, rival.samples, iters) if compare else "-"
        lines.append(
            f"| {row.group} | {row.name} | {row.wire_bytes / 1e6:.2f} | {row.wire_bytes / fp32:.4f} "
            f"| {s.median_ms:.1f} | {s.p90_ms:.1f} | {s.median_ms / reference:.2f} "
            f"| {to_floor} | {to_torch} | {source} |"
        )
    for name, outcome in probes.items():
        lines.append(f"| probe | {name} | - | - | - | - | - | - | - | {outcome} |")
    return lines


def _ratio(samples: list[float], reference: list[float], iters: int) -> str:
    ratio, low, high = paired_ratio(samples, reference, iters)
    return f"{ratio:.3f} [{low:.3f}, {high:.3f}]"


def best_hooks(rows: list[Row], iters: int) -> list[str]:
    """The issue's two targets for the best hook, read off the same-group ratios to no communication."""
    floor = {r.group: r.samples for r in rows if r.name == NO_COMM.name}
    compressing = [r for r in rows if r.group != "plain" and r.name != NO_COMM.name]
    if not compressing:
        return []
    ratios = {r.name: paired_ratio(r.samples, floor[r.group], iters) for r in compressing}
    ours = min((r for r in compressing if r.name.startswith("gradsync")), key=lambda r: ratios[r.name][0], default=None)
    theirs = min((r for r in compressing if r.name.startswith("torch")), key=lambda r: ratios[r.name][0], default=None)
    lines = ["", "Best hooks, each as a multiple of the no-communication step measured in the same rounds:", ""]
    for label, row in (("gradsync", ours), ("torch", theirs)):
        if row is not None:
            ratio, low, high = ratios[row.name]
            lines.append(f"- {label}'s best: {row.name}, {ratio:.3f}x no communication [{low:.3f}, {high:.3f}]")
    if ours is not None and theirs is not None:
        mine, torch_best = ratios[ours.name][0], ratios[theirs.name][0]
        lines.append(
            f"- gradsync's best / torch's best = {mine / torch_best:.3f} (ratio of the two floor ratios); "
            f"0.80x torch's best would be {0.8 * torch_best:.3f}x no communication, "
            + ("below the floor itself: no reducer can reach it" if 0.8 * torch_best < 1 else "above the floor")
        )
    return lines


def write_report(rows: list[Row], probes: dict[str, str], load: MachineLoad, args: Any) -> str:
    params = list(WORKLOAD.build().parameters())
    nbytes = dense_bytes(WORKLOAD.build())
    lines = [
        f"# Communication hooks: bytes on the wire and iteration time ({today()})",
        "",
        *environment_lines(launch.command_line()),
    ]
    lines += [
        f"- machine load: {load.describe()}",
        f"- model: `{WORKLOAD.name}`, {WORKLOAD.description}; {len(params)} parameter tensors, "
        f"{sum(p.numel() for p in params) / 1e6:.1f} M parameters, {mib(nbytes)} MiB of fp32 gradients",
        f"- per group: {args.warmup} warm-up iterations per contender (PowerSGD compresses from iteration 2 "
        f"on), then {args.rounds} rounds x {args.iters} iterations, interleaved; time = slowest rank's",
        "- iteration = zero_grad(set_to_none=True), forward, loss, backward, SGD step; both DDPs with default "
        "buckets (25 MiB, 1 MiB first)",
        "- bytes on the wire = bytes one rank sends per iteration under ring algorithms (all-reduce "
        "2(W-1)/W n, all-gather (W-1) n); gradsync's from `state.wire` over the timed iterations, torch's "
        "computed from parameter shapes the same way",
        "- torch's `powerSGD_hook` deadlocks on gloo with DDP's default buckets (it issues the P and Q "
        "all-reduces from gloo's callback threads, in a different order on each rank; seen at the first "
        f"compressing iteration), so it runs with one bucket (`bucket_cap_mb={ONE_BUCKET_MB}`), as does "
        "one gradsync row for a like-for-like comparison",
        "- every group also runs the no-communication step (a plain module, same optimizer) interleaved with "
        "its contenders; 'same rounds' ratios are the median over rounds of each round's median ratio, with a "
        "percentile-bootstrap 90% interval (common.py's `paired_ratio`), which cancels drift between groups",
        "- torch's `bf16_compress_hook` and quantization hooks were probed on a tiny model "
        "(Linear(64, 64), Linear(64, 8)); the outcome is quoted in the last rows",
        "",
        *table(rows, probes, nbytes, args.iters),
        *best_hooks(rows, args.iters),
        "",
    ]
    path = report_path("hooks")
    path.write_text("\n".join(lines))
    return str(path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--warmup", type=int, default=4, help="iterations per contender before timing (>= 3)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--iters", type=int, default=3, help="iterations per contender per round")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="large_grad")
    parser.add_argument(
        "--link",
        help="rate of a shaped loopback link (1gbit, 10gbit, ...): start with python, not torchrun (see lib/link.py)",
    )
    return parser.parse_args()


def main() -> None:
    global WORKLOAD
    args = parse_args()
    link.enter(args.link, nproc=2)  # with --link: runs this script inside a shaped namespace, then exits
    WORKLOAD = WORKLOADS[args.workload]
    torch.set_num_threads(1)  # one core per rank; extra threads would fight the other rank
    dist.init_process_group(backend="gloo")
    probes = {name: probe(hook) for name, hook in TORCH_PROBES.items()}
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [WORKLOAD.make_batch(generator) for _ in range(4)]
    torch.manual_seed(0)
    base = WORKLOAD.build()
    load = MachineLoad()
    load.start()
    rows: list[Row] = []
    for group in args.groups:
        rows += measure_group(group, GROUPS[group], base, batches, args)
        if dist.get_rank() == 0:
            print(f"{group}: done", flush=True)
    load.stop()
    if dist.get_rank() == 0:
        path = write_report(rows, probes, load, args)
        print(open(path).read())
        print(f"report: {path}")
    dist.barrier()  # leave together: a rank tearing down gloo while its peer still runs can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
