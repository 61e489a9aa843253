"""One member of one island of benchmarks/studies/diloco_island_faults.py: the character LM under FaultTolerantDiLoCo.

Started by that study, one torchrun per island (``RANK``/``WORLD_SIZE`` are the island's), inside the
island's network namespace::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m benchmarks.studies.diloco_island_worker \\
        --store ADDR --run-id ID --island C --slot 2 --out DIR [--fault inner:60 --victim 1]

The model, data and loss are benchmarks/studies/diloco_task.py's (examples/train_charlm.py's CharLM
0.44 M, AdamW inner lr 1e-3, weight decay 0.1, betas 0.9/0.95), the replica a gradsync DDP over
``run.island_group``, the outer optimizer Nesterov (lr 0.7, momentum 0.9). Member ``m`` of island slot
``s`` trains at inner step ``t`` on ``charlm.batch`` drawn from a generator seeded by (seed, s, m, t),
so a restarted island, healed to step ``t``, draws what an undisturbed run draws there.

Faults, in the first incarnation of member ``--victim`` only (torchrun's ``TORCHELASTIC_RESTART_COUNT``
0): ``inner:T`` SIGKILLs it before inner step ``T``; ``exchange:K`` SIGKILLs it in outer step ``K``'s
exchange, before its second all-to-all (its reduce-scatter across the islands done, the all-gather
not); ``nan:T`` writes a NaN into its first parameter before inner step ``T`` (a bad contribution).

Each process appends JSON lines to ``<out>/<island>-m<member>-r<restart>.jsonl``: ``started``,
``joined`` (healed), ``died`` / ``injected`` (just before), and per committed outer step its
contributors, those left out, whether every value of theta_global is finite, the inner steps this
process took so far, and how long the ``step()`` call that committed it took (the exchange, the
decision, any redo among the survivors, any heal). Island slot 0's member 0 saves theta_global after every outer step
(``theta-K.pt``) for the study to evaluate. At the end: ``<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from benchmarks.studies.diloco_task import charlm
from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.elastic_diloco import FaultTolerantDiLoCo

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # diloco_task's gradsync.diloco.nesterov


def outer_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def data_seed(seed: int, slot: int, member: int, step: int) -> int:
    """The generator seed of island slot ``slot``'s member ``member`` at inner step ``step``."""
    return ((seed * 100 + slot) * 10 + member) * 1_000_003 + step


class Log:
    """This process's JSON lines, flushed at once (a SIGKILL loses nothing written before it)."""

    def __init__(self, path: Path, me: dict[str, Any]) -> None:
        self.file: TextIO = path.open("a")
        self.me = me

    def write(self, **entry: Any) -> None:
        self.file.write(json.dumps({**self.me, **entry, "t": time.time()}) + "\n")
        self.file.flush()


def die_in_exchange(outer: FaultTolerantDiLoCo, at: int, log: Log) -> None:
    """SIGKILL this process in outer step ``at``'s exchange, before its second all-to-all (the first is the
    reduce-scatter across the islands, the second the all-gather across, the third the island's all-gather)."""
    real = dist.all_to_all_single
    calls = [0]

    def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
        if outer.outer_steps == at:
            calls[0] += 1
            if calls[0] == 2:
                log.write(died="exchange", outer_step=at)
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def save_theta(outer: FaultTolerantDiLoCo, path: Path) -> None:
    """theta_global by parameter name (one fragment: its flat tensor split by the parameters' sizes)."""
    (fragment,) = outer.outer.fragments
    parts = fragment.theta.detach().split(fragment.sizes)
    shaped = {name: part.view_as(param).clone() for name, part, param in zip(fragment.names, parts, fragment.params)}
    torch.save(shaped, path)


def theta_finite(outer: FaultTolerantDiLoCo) -> bool:
    return all(bool(torch.isfinite(theta).all()) for theta in outer.outer.global_parameters)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one island member of the diloco_island_faults study")
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--island", required=True)
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fault", default="")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=10.0)
    return p.parse_args()


def build(args: argparse.Namespace, vocabulary: int) -> tuple[Any, torch.nn.Module, Any, FaultTolerantDiLoCo]:
    run = elastic.init(
        store=args.store, run_id=args.run_id, replicas=args.replicas, timeout_s=args.timeout,
        heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=120.0, island=args.island,
    )  # fmt: skip
    torch.manual_seed(args.seed)  # every island starts from the same weights (a joiner is healed anyway)
    model = charlm.CharLM(vocabulary, 128, 2)
    replica = DDP(model, process_group=run.island_group)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    outer = FaultTolerantDiLoCo(replica, inner, args.sync_every, outer_optimizer=outer_optimizer)
    return run, replica, inner, outer


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    out = Path(args.out)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    member = int(os.environ["RANK"])
    phase, _, at_text = args.fault.partition(":")
    if restart or member != args.victim:
        phase = ""  # the fault is the first incarnation's victim's alone
    at = int(at_text) if phase else -1
    name = f"{args.island}-m{member}-r{restart}"
    log = Log(out / f"{name}.jsonl", {"island": args.island, "member": member, "restart": restart})
    log.write(started=os.getpid())
    train_data, _, vocabulary = charlm.corpus()
    run, replica, inner, outer = build(args, vocabulary)
    log.me["uuid"] = outer.island_id
    if run.history and run.history[-1].get("healed_from"):
        log.write(joined=outer.outer_steps, source=run.history[-1]["healed_from"], step=outer.step_count)
    if phase == "exchange":
        die_in_exchange(outer, at, log)
    inner_steps = train(args, outer, replica, inner, train_data, log, (phase, at, member))
    result = {**log.me, "inner_steps": inner_steps, "step": outer.step_count, "outer_steps": outer.outer_steps}
    result.update(identical=outer.replicas_identical(), history=run.history, redone=outer.exchange.redone)
    (out / f"{name}.json").write_text(json.dumps(result))
    dist.barrier()  # nobody leaves while another still compares
    outer.close()


def train(
    args: argparse.Namespace,
    outer: FaultTolerantDiLoCo,
    replica: torch.nn.Module,
    inner: torch.optim.Optimizer,
    train_data: torch.Tensor,
    log: Log,
    fault: tuple[str, int, int],
) -> int:
    """The loop, on the outer object's step count; the inner steps this process took."""
    phase, at, member = fault
    taken = 0
    generator = torch.Generator()
    while outer.step_count < args.steps:
        step = outer.step_count
        if phase == "inner" and step == at:
            log.write(died="inner", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if phase == "nan" and step == at:
            with torch.no_grad():
                outer.outer.fragments[0].params[0].view(-1)[0] = float("nan")
            log.write(injected="nan", step=step)
        generator.manual_seed(data_seed(args.seed, args.slot, member, step))
        charlm.loss_of(replica, *charlm.batch(train_data, args.batch, generator)).backward()
        before, start = outer.outer_steps, time.perf_counter()
        outer.step()  # at an outer step: the exchange, the decision, any redo and heal
        took = time.perf_counter() - start
        inner.zero_grad()
        taken += 1
        if outer.outer_steps == before + 1:
            log.write(outer_step=before, contributors=outer.contributors, excluded=outer.excluded,
                      finite=theta_finite(outer), inner_steps=taken, step=outer.step_count, step_s=took)  # fmt: skip
            if args.slot == 0 and member == 0:
                save_theta(outer, Path(args.out) / f"theta-{before}.pt")
    return taken


if __name__ == "__main__":
    main()
