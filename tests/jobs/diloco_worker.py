"""One replica of a fault-tolerant DiLoCo run, for tests/test_diloco_elastic.py: trains, logs, may die on cue.

Every committed outer step appends ``{"outer_step", "contributors"}`` (the uuids whose outer
gradients it averaged, in rank order) to ``<out>/<name>.jsonl``; a replica healed on arrival
appends ``{"joined", "source"}`` first. Each line also names this process (``uuid``, ``slot``).
From these a single-process replay redoes exactly the committed outer steps. At the end it
writes ``<name>.json`` and ``<name>.pt`` (its parameters and theta_global).

The data of replica slot ``s`` at inner step ``t`` is ``batch(s, t)``: a restarted replica keeps
its slot. ``--fault inner:T`` SIGKILLs this process before its inner step ``T``; ``--fault
exchange:K`` SIGKILLs it in outer step ``K``'s exchange, after its reduce-scatter completed and
before its all-gather (the others then wait for pieces that never come). With ``--delay`` the
exchange runs on a thread while the inner steps go on (Streaming DiLoCo): ``inner:T`` at a step
where an exchange is in flight kills the replica between its exchange's start and its landing.

Islands (``--island NAME``, launched by torchrun, one per island: ``RANK``/``WORLD_SIZE`` are the
island's): the replica is a gradsync DDP over ``run.island_group``; member ``m`` of island slot ``s``
trains on ``batch(island_seed(s, m), t)``. Entries then name the replica by ``uuid`` = its island's
first member's uuid (``outer.island_id``, the replica the outer steps average) and the process by
``process``. A fault applies to the island member ``--victim`` of the first incarnation only
(torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0); ``gather:K`` SIGKILLs in outer step ``K``'s island
all-gather, ``hang:T`` SIGSTOPs before inner step ``T``. ``nan:T`` writes a NaN into the first
parameter before inner step ``T``, ``scale:T`` moves the parameters to ``theta_global +
factor * (local - theta_global)`` there (``--factor``): bad contributions, logged as ``injected``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from etcd_worker import _count_requests  # the training thread's etcd requests
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.elastic_diloco import FaultTolerantDiLoCo
from gradsync.zero import ShardedOptimizer

WIDTH = 16


def make_model(batchnorm: bool = False) -> nn.Module:
    """``batchnorm``: a BatchNorm1d after the first layer (running statistics: buffers averaged once a round)."""
    torch.manual_seed(0)
    if batchnorm:
        return nn.Sequential(nn.Linear(WIDTH, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 4))


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def make_sharded(ddp: DDP, stage: int) -> ShardedOptimizer:
    """make_inner's AdamW, sharded over the island (gradsync.zero)."""
    return ShardedOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.01)


def batch(slot: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * slot + step)
    return torch.randn(8, WIDTH, generator=g), torch.randint(0, 4, (8,), generator=g)


def island_seed(slot: int, member: int) -> int:
    """The data seed of island slot ``slot``'s member ``member`` (a plain replica's is its slot)."""
    return 1000 * (member + 1) + slot


def inject(kind: str, outer: FaultTolerantDiLoCo, factor: float) -> None:
    """A bad contribution: a NaN in the first parameter, or the parameters moved ``factor`` times as far."""
    with torch.no_grad():
        if kind == "nan":
            first = outer.outer.fragments[0].params[0]
            first.view(-1)[0] = float("nan")
        else:
            for fragment in outer.outer.fragments:
                fragment.write(fragment.theta.detach() + factor * (fragment.local() - fragment.theta.detach()))


def residual_norm(outer: FaultTolerantDiLoCo) -> float:
    """The sum of |residual| over this process's error-feedback residuals (0 without feedback)."""
    feedback = outer.outer.feedback
    if feedback is None:
        return 0.0
    return sum(float(r.sent.abs().sum() + r.owned.abs().sum()) for r in feedback.residuals)


DIED: list[Path] = []  # where the victim writes when it kills (or stops) itself


def die(sig: int = signal.SIGKILL) -> None:
    for path in DIED:
        path.write_text(f"{os.getpid()} {time.time()!r}")
    os.kill(os.getpid(), sig)


def main() -> None:
    import faulthandler
    import logging

    faulthandler.enable()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--wire", default="fp32")
    p.add_argument("--delay", type=int, default=0)
    p.add_argument("--merge", default="mix")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--await-joiner", action="store_true", help="also run until a joiner took part in 2 outer steps")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--fault", default="")
    p.add_argument("--sleep", type=float, default=0.01)
    p.add_argument("--island", default=None, help="train in this island (launched by torchrun, one per island)")
    p.add_argument("--victim", type=int, default=0, help="the island member the fault applies to")
    p.add_argument("--factor", type=float, default=1000.0)
    p.add_argument("--max-norm-ratio", type=float, default=None)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-exclusions", type=int, default=3)
    p.add_argument("--zero", type=int, default=0, help="a ShardedOptimizer of this stage inside the island")
    args = p.parse_args()
    torch.set_num_threads(1)
    phase, _, at = args.fault.partition(":")
    at = int(at) if at else -1
    out = Path(args.out)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    member = int(os.environ.get("RANK", "0")) if args.island else 0
    if restart or member != args.victim:
        phase, at = "", -1  # the fault is the first incarnation's victim's alone
    name = args.name if args.island is None else f"{args.name}-m{member}-r{restart}"
    DIED.append(out / f"{name}.died")

    run = elastic.init(
        store=args.store, run_id=args.run_id, replicas=args.replicas, timeout_s=5.0, heartbeat_timeout_s=1.5,
        join_timeout_s=60.0, island=args.island, min_replicas=args.min_replicas,
    )  # fmt: skip
    requests, _ = _count_requests(run.store)  # no waits on the group between outer steps: none excused
    model = make_model(args.batchnorm)
    trained = DDP(model, process_group=run.island_group) if args.island else model
    inner = make_sharded(trained, args.zero) if args.zero else make_inner(model)
    seed = island_seed(args.slot, member) if args.island else args.slot
    joiner = run.joining
    outer = FaultTolerantDiLoCo(
        trained, inner, sync_every=args.sync_every, fragments=args.fragments, wire=args.wire, delay=args.delay,
        merge=args.merge, error_feedback=args.error_feedback, max_norm_ratio=args.max_norm_ratio,
        max_exclusions=args.max_exclusions,
    )  # fmt: skip
    if phase in ("exchange", "gather"):
        _die_in_exchange(outer, at, 2 if phase == "exchange" else 3)
    me = {"uuid": outer.island_id, "process": run.uuid, "slot": args.slot, "name": name, "size": run.island_size}
    me["islanded"] = args.island is not None
    log = (out / f"{name}.jsonl").open("a")
    if joiner:
        healed = run.history[-1]
        entry = {**me, "joined": outer.outer_steps, "source": healed["healed_from"], "t": time.time()}
        entry["residuals"] = residual_norm(outer)
        log.write(json.dumps(entry) + "\n")
        log.flush()

    def waiting() -> bool:  # the same answer on every member at the same outer step
        """Until a joiner has been a member for two outer steps (it contributed to them)."""
        admitted = [h["outer_steps"] for h in run.history if h["reason"].startswith(("admitting", "joined"))]
        return args.await_joiner and (not admitted or outer.outer_steps < admitted[0] + 2)

    requests_after_step = []
    in_flight_after_steps = 0  # steps after which an exchange was still in flight (Streaming: delay of them)
    while outer.step_count < args.steps or waiting() or outer.exchange_in_flight:  # end at a landing
        step = outer.step_count
        if phase == "inner" and step == at:
            die()
        if phase == "hang" and step == at:
            die(signal.SIGSTOP)
        if phase in ("nan", "scale") and step == at:
            inject(phase, outer, args.factor)
            log.write(json.dumps({**me, "injected": phase, "step": step, "factor": args.factor}) + "\n")
        x, y = batch(seed, step)
        nn.functional.cross_entropy(trained(x), y).backward()
        before = outer.outer_steps
        outer.step()
        inner.zero_grad()
        requests_after_step.append((outer.step_count, requests[0]))
        in_flight_after_steps += outer.exchange_in_flight
        if outer.outer_steps == before + 1:
            entry = {**me, "outer_step": before, "contributors": outer.contributors, "t": time.time()}
            entry["excluded"] = outer.excluded
            entry["residuals"] = residual_norm(outer)
            log.write(json.dumps(entry) + "\n")
            log.flush()
        time.sleep(args.sleep)
    result = {
        **me,
        "member": member,
        "pid": os.getpid(),
        "identical": outer.replicas_identical(),
        "step": outer.step_count,
        "outer_steps": outer.outer_steps,
        "world_size": outer.world_size,
        "history": run.history,
        "redone": outer.exchange.redone,
        "requests_after_step": requests_after_step,
        "sync_every": args.sync_every,
        "fragments": args.fragments,
        "delay": args.delay,
        "in_flight_after_steps": in_flight_after_steps,
        "merge": args.merge,
        "wire": args.wire,
        "error_feedback": args.error_feedback,
        "batchnorm": args.batchnorm,
        "zero": args.zero,
    }
    state = {"model": model.state_dict(), "theta": [t.detach().clone() for t in outer.outer.global_parameters]}
    torch.save(state, out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody leaves while another still checks
    outer.close()


def _die_in_exchange(outer: FaultTolerantDiLoCo, at: int, call: int) -> None:
    """SIGKILL this process in outer step ``at``'s exchange, before its ``call``-th all-to-all: 2, between the
    reduce-scatter and the all-gather across; 3, the island all-gather of the averaged slices."""
    real = dist.all_to_all_single
    calls = [0]

    def all_to_all_single(*args: object, **kwargs: object) -> object:
        if outer.outer_steps == at:
            calls[0] += 1
            if calls[0] == call:
                die()
        return real(*args, **kwargs)

    dist.all_to_all_single = all_to_all_single


if __name__ == "__main__":
    main()
