"""One trainer of a fault-tolerant run, for tests/test_elastic.py: trains, logs, may die on cue.

Every committed step appends ``{"step", "seed"}`` to ``<out>/<name>.jsonl`` (the seed names the
batch this process contributed), so a single-process replay can redo exactly the committed
steps. At the end it writes ``<name>.json`` (fingerprint, history) and ``<name>.pt`` (weights).

``--fault PHASE:STEP`` makes this process fail there: ``forward``, ``backward``, ``reduction``
(in the comm hook), ``between`` (after a committed step) are SIGKILLs; ``hang`` SIGSTOPs itself
mid-backward, ``hang-forward`` before its forward; ``disagree`` fails its last bucket locally (no
death); ``heal`` dies as the heal source of a joiner; ``vote-lost`` takes its completed vote for
a failed one (the others committed the step: it must learn that through the store);
``hang-after-vote`` SIGSTOPs itself right after its vote completed; ``nonfinite`` puts a NaN and
an inf in its gradients of that step (of parameters ``3.weight`` and ``5.bias``, during backward,
so that they are reduced too), ``nonfinite-from`` in those of every step from that one on (run with
``--reject-nonfinite``). A step of this process that the others revoked (it was taken for dead
after its vote) is logged as ``{"revoked": step}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.elastic import commit, heal
from gradsync.hooks import PowerSGDState, allreduce_hook, powersgd_hook
from gradsync.zero import ShardedOptimizer

WIDTH = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, 4),
    )  # fmt: skip


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, WIDTH, generator=g), torch.randint(0, 4, (8,), generator=g)


def sha256_of(module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A digest of every parameter and optimizer-state tensor (equal digests: equal bits)."""
    digest = hashlib.sha256()
    tensors = list(module.parameters())
    tensors += [t for s in optimizer.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def seed_of(step: int, rank: int, world: int) -> int:
    return step * 1000 + world * 10 + rank


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
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--final-world", type=int, default=0, help="also run until the world has this size")
    p.add_argument("--await-joiner", action="store_true", help="also run until a joiner was admitted")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--fault", default="")
    p.add_argument("--hook", default="")
    p.add_argument("--bucket-cap-mb", type=float, default=0.002)
    p.add_argument("--divisor", default="survivors")
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--sharded", type=int, default=0, help="a gradsync.zero.ShardedOptimizer of this stage")
    p.add_argument("--reject-nonfinite", action="store_true")
    p.add_argument("--max-exclusions", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    phase, _, at = args.fault.partition(":")
    at_step = int(at) if at else -1
    out = Path(args.out)

    run = elastic.init(
        store=args.store, run_id=args.run_id, replicas=args.replicas, min_replicas=args.min_replicas,
        timeout_s=5.0, heartbeat_timeout_s=1.5, join_timeout_s=60.0,
    )  # fmt: skip
    ddp = DDP(make_model(), bucket_cap_mb=args.bucket_cap_mb)
    hook_state = None
    if args.hook == "powersgd":
        hook_state = PowerSGDState(None, matrix_approximation_rank=2, start_iter=2)
        ddp.register_comm_hook(hook_state, powersgd_hook)
    elif phase in ("reduction", "disagree"):
        ddp.register_comm_hook(None, _faulty_allreduce(phase, at_step))
    if args.sharded:
        opt = ShardedOptimizer(ddp, torch.optim.SGD, stage=args.sharded, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    divisor = int(args.divisor) if args.divisor.isdigit() else args.divisor
    if phase == "heal":
        _die_as_heal_source()
    if phase in ("vote-lost", "hang-after-vote"):
        _after_the_vote(phase, at_step)
    joiner = run.joining
    ft = elastic.FaultTolerant(
        ddp, opt, divisor=divisor, reject_nonfinite=args.reject_nonfinite, max_exclusions=args.max_exclusions
    )
    _STATE["ft"] = ft
    log = (out / f"{args.name}.jsonl").open("a")
    current = {"step": -1, "seed": -1}
    revoked = 0  # history entries looked at for revoked steps
    optimizer_step = opt.step

    def logged_step() -> None:  # FaultTolerant steps the optimizer only for a committed step
        log.write(json.dumps(current) + "\n")
        log.flush()
        optimizer_step()

    opt.step = logged_step
    if phase == "backward" or phase == "hang":
        first = ddp.module[0].weight  # its gradient comes last in backward: most buckets are in flight
        first.register_hook(lambda g: _fault_now(phase, at_step, ft) or g)
    if phase in ("nonfinite", "nonfinite-from"):
        ddp.module[3].weight.register_hook(lambda g: _poisoned(g, phase, at_step, ft, float("nan")))
        ddp.module[5].bias.register_hook(lambda g: _poisoned(g, phase, at_step, ft, float("inf")))

    def waiting() -> bool:  # the same answer on every member at the same step
        admitted = any(h["reason"].startswith("admitting") for h in run.history)
        return args.await_joiner and not (joiner or admitted)

    while ft.step_count < args.steps or ft.world_size < args.final_world or waiting():
        step = ft.step_count
        seed = seed_of(step, ft.rank, ft.world_size)
        x, y = batch(seed)
        if phase == "forward" and step == at_step:
            die()
        if phase == "hang-forward" and step == at_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        current.update(step=step, seed=seed)
        ft.step()
        for entry in run.history[revoked:]:
            if "revoked" in entry:
                log.write(json.dumps({"revoked": entry["revoked"]}) + "\n")
                log.flush()
        revoked = len(run.history)
        if phase == "between" and step == at_step:
            die()
        time.sleep(args.sleep)
    write_result(out, args.name, ddp, opt, ft, run.history, hook=_hook_digest(hook_state))


def write_result(
    out: Path,
    name: str,
    ddp: DDP,
    opt: torch.optim.Optimizer,
    ft: elastic.FaultTolerant,
    history: list,
    **extra: object,
) -> None:
    """What a test reads of a finished replica (NAME.json, NAME.pt), then leave together."""
    result = {
        "name": name,
        "pid": os.getpid(),
        "fingerprint": sha256_of(ddp.module, opt),
        "identical": ft.replicas_identical(),
        "step": ft.step_count,
        "world_size": ft.world_size,
        "generation": ft.generation,
        "history": history,
        **extra,
    }
    torch.save(ddp.module.state_dict(), out / f"{name}.pt")
    (out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody leaves while another still checks
    ft.close()


_STATE: dict = {}


def _fault_now(phase: str, at_step: int, ft: elastic.FaultTolerant) -> None:
    if ft.step_count != at_step:
        return None
    if phase == "backward":
        die()
    if phase == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    return None


def _poisoned(grad: torch.Tensor, phase: str, at_step: int, ft: elastic.FaultTolerant, value: float) -> torch.Tensor:
    if ft.step_count == at_step or (phase == "nonfinite-from" and ft.step_count > at_step):
        grad = grad.clone()
        grad.view(-1)[0] = value
    return grad


def _faulty_allreduce(phase: str, at_step: int):  # noqa: ANN202
    def hook(state, bucket):  # noqa: ANN001, ANN202 - torch checks hook annotations
        ft = _STATE.get("ft")
        if ft is not None and ft.step_count == at_step and ft.generation == 0:
            if phase == "reduction" and bucket.index() == 1:
                die()
            if phase == "disagree" and bucket.is_last():
                fut: torch.futures.Future = torch.futures.Future()
                fut.set_exception(RuntimeError("injected: this rank's last bucket failed"))
                return fut
        return allreduce_hook(state, bucket)

    return hook


def _die_as_heal_source() -> None:
    real = heal.transfer

    def transfer(payload, source, group, device):  # noqa: ANN001, ANN202
        if payload is not None and dist.get_world_size() > 2 and _STATE.get("ft") is not None:
            die()  # the source of a joiner's heal, before anything was sent
        return real(payload, source, group, device)

    heal.transfer = transfer


def _after_the_vote(phase: str, at_step: int) -> None:
    real = commit.vote

    def vote(arrivals_known, silent, wait, abandoned, per_rank=None):  # noqa: ANN001, ANN202
        fewest = real(arrivals_known, silent, wait, abandoned, per_rank)
        ft = _STATE.get("ft")
        if ft is not None and ft.step_count == at_step and ft.generation == 0:
            if phase == "hang-after-vote":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                raise RuntimeError("the commit vote failed: injected after it completed")
        return fewest

    commit.vote = vote


def _hook_digest(state: PowerSGDState | None) -> str:
    if state is None:
        return ""
    qs = [state.q_memory.get(b) for b in range(64) if state.q_memory.get(b) is not None]
    return str([round(float(q.double().sum()), 12) for q in qs]) + f"/iter={state.iter}"


if __name__ == "__main__":
    main()
