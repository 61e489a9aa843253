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

from gradsync import elastic
from gradsync.elastic_diloco import FaultTolerantDiLoCo

WIDTH = 16


def make_model(batchnorm: bool = False) -> nn.Module:
    """``batchnorm``: a BatchNorm1d after the first layer (running statistics: buffers averaged once a round)."""
    torch.manual_seed(0)
    if batchnorm:
        return nn.Sequential(nn.Linear(WIDTH, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
    return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, 4))


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(slot: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * slot + step)
    return torch.randn(8, WIDTH, generator=g), torch.randint(0, 4, (8,), generator=g)


def residual_norm(outer: FaultTolerantDiLoCo) -> float:
    """The sum of |residual| over this process's error-feedback residuals (0 without feedback)."""
    feedback = outer.outer.feedback
    if feedback is None:
        return 0.0
    return sum(float(r.sent.abs().sum() + r.owned.abs().sum()) for r in feedback.residuals)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


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
    args = p.parse_args()
    torch.set_num_threads(1)
    phase, _, at = args.fault.partition(":")
    at = int(at) if at else -1
    out = Path(args.out)

    run = elastic.init(
        store=args.store, run_id=args.run_id, replicas=args.replicas, timeout_s=5.0, heartbeat_timeout_s=1.5,
        join_timeout_s=60.0,
    )  # fmt: skip
    requests = _count_requests(run.store)
    model = make_model(args.batchnorm)
    inner = make_inner(model)
    joiner = run.joining
    outer = FaultTolerantDiLoCo(
        model, inner, sync_every=args.sync_every, fragments=args.fragments, wire=args.wire, delay=args.delay,
        merge=args.merge, error_feedback=args.error_feedback,
    )  # fmt: skip
    if phase == "exchange":
        _die_in_exchange(outer, at)
    me = {"uuid": run.uuid, "slot": args.slot, "name": args.name}
    log = (out / f"{args.name}.jsonl").open("a")
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
        x, y = batch(args.slot, step)
        nn.functional.cross_entropy(model(x), y).backward()
        before = outer.outer_steps
        outer.step()
        inner.zero_grad()
        requests_after_step.append((outer.step_count, requests[0]))
        in_flight_after_steps += outer.exchange_in_flight
        if outer.outer_steps == before + 1:
            entry = {**me, "outer_step": before, "contributors": outer.contributors, "t": time.time()}
            entry["residuals"] = residual_norm(outer)
            log.write(json.dumps(entry) + "\n")
            log.flush()
        time.sleep(args.sleep)
    result = {
        **me,
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
    }
    state = {"model": model.state_dict(), "theta": [t.detach().clone() for t in outer.outer.global_parameters]}
    torch.save(state, out / f"{args.name}.pt")
    (out / f"{args.name}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody leaves while another still checks
    outer.close()


def _die_in_exchange(outer: FaultTolerantDiLoCo, at: int) -> None:
    """SIGKILL this process in outer step ``at``'s exchange, between its two all-to-alls."""
    real = dist.all_to_all_single
    calls = [0]

    def all_to_all_single(*args: object, **kwargs: object) -> object:
        if outer.outer_steps == at:
            calls[0] += 1
            if calls[0] == 2:
                die()
        return real(*args, **kwargs)

    dist.all_to_all_single = all_to_all_single


if __name__ == "__main__":
    main()
