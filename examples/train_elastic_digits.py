"""Fault-tolerant training of the digits MLP: a replica dies mid-backward, the others go on, it heals.

One command per replica, each under its own torchrun (so a dead replica is restarted alone),
around a store that belongs to none of them (``make demo-elastic`` runs all of this through
examples/elastic_demo.py):

    python -m gradsync.elastic.store --port 29400 &
    for i in 0 1 2; do
        GRADSYNC_STORE=localhost:29400 GRADSYNC_REPLICAS=3 OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc-per-node 1 --max-restarts 3 examples/train_elastic_digits.py &
    done

On several machines: the same command on each, with GRADSYNC_STORE naming the store's host.
``--kill-at-step N`` makes the replica that has rank ``--kill-rank`` (2) SIGKILL itself in the
middle of backward at step N (first attempt only): the survivors abandon the step's collectives,
agree on the new membership, redo the step's reduction over themselves and continue; torchrun
restarts the replica, which joins at the next committed step and is healed from a survivor. At
the end rank 0 replays the committed steps in one process (the batches of exactly the members of
each step) and checks it reaches the same test accuracy, and every replica checks the others hold
identical weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm
from train_digits import accuracy, load_splits, make_model, make_optimizer  # examples/ is on sys.path

from gradsync import DistributedDataParallel as DDP
from gradsync import elastic

BATCH = 32


def batch_indices(step: int, rank: int, world: int, size: int) -> torch.Tensor:
    """This member's batch at ``step``: drawn from a seed every process (and the replay) can recompute."""
    generator = torch.Generator().manual_seed(step * 1000 + world * 10 + rank)
    return torch.randint(0, size, (BATCH,), generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=2, help="the rank that dies at --kill-at-step")
    parser.add_argument("--step-delay", type=float, default=0.03, help="seconds per step, so a person can watch")
    parser.add_argument("--log-dir", type=Path, default=Path(os.environ.get("GRADSYNC_DEMO_LOGS", "elastic-logs")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_set, test_set = load_splits()
    run = elastic.init(heartbeat_timeout_s=2.0, timeout_s=10.0)
    joiner = run.joining
    model = DDP(make_model())
    optimizer = make_optimizer(model)
    bar = None
    reporting = False  # whether this process reports progress: known once FaultTolerant has a rank

    def on_reconfigure(rank: int, world_size: int, step: int) -> None:
        line = f"step {step}: world size {world_size} (generation {run.generation.number})"
        if bar is not None and not bar.disable:
            bar.set_postfix(world=world_size)
            bar.write(line)
        elif reporting:
            print(line, flush=True)

    ft = elastic.FaultTolerant(model, optimizer, on_reconfigure=on_reconfigure)
    if joiner:
        print(f"[joiner] healed from a live peer at step {ft.step_count}: world size {ft.world_size}", flush=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = (args.log_dir / f"{run.uuid}.jsonl").open("a")
    current: dict[str, int] = {}
    optimizer_step = optimizer.step

    def committed_step() -> None:  # FaultTolerant steps the optimizer only for a committed step
        log.write(json.dumps(current) + "\n")
        log.flush()
        optimizer_step()

    optimizer.step = committed_step  # type: ignore[method-assign]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.kill_at_step >= 0 and attempt == 0:
        first = model.module[0].weight  # its gradient comes last: the other buckets are in flight by then
        first.register_hook(lambda g: _die() if (ft.step_count, ft.rank) == (args.kill_at_step, args.kill_rank) else g)
    # A bar only on a terminal: in a log file (CI, | tee) each refresh would be a line of its own.
    # There a line per tenth of the steps reports the progress instead.
    on_terminal = sys.stderr.isatty()
    reporting = ft.rank == 0 and not joiner
    bar = tqdm(total=args.steps, initial=ft.step_count, disable=not (reporting and on_terminal), desc="steps")
    log_every = max(args.steps // 10, 1) if reporting and not on_terminal else 0
    bar.set_postfix(world=ft.world_size)
    x_all, y_all = train_set.tensors
    loss_fn = nn.CrossEntropyLoss()
    # Until every replica is back (or long past the plan): the same decision on every member.
    while ft.step_count < args.steps or (ft.world_size < run.replicas and ft.step_count < 3 * args.steps):
        index = batch_indices(ft.step_count, ft.rank, ft.world_size, len(x_all))
        current.update(step=ft.step_count, rank=ft.rank, world=ft.world_size)
        optimizer.zero_grad()
        loss_fn(model(x_all[index]), y_all[index]).backward()
        if ft.step():
            bar.update(1)
            if log_every and ft.step_count % log_every == 0:
                print(f"step {ft.step_count}/{args.steps}, world size {ft.world_size}", flush=True)
        time.sleep(args.step_delay)
    bar.close()
    identical = ft.replicas_identical()
    mine = accuracy(model.module, test_set)
    dist.barrier()  # every log is complete
    if ft.rank == 0:
        replayed = accuracy(replay(args.log_dir, train_set, ft.step_count), test_set)
        print(f"test accuracy: {mine:.4f} (single-process replay of the committed steps: {replayed:.4f})")
        print(f"same accuracy as the replay: {abs(mine - replayed) < 1e-6}")
    print(f"replicas identical: {identical} (rank {ft.rank} of {ft.world_size})", flush=True)
    ft.close()
    if not identical:
        raise SystemExit(1)


def replay(log_dir: Path, train_set, steps: int) -> nn.Module:  # noqa: ANN001
    """One process, the committed steps: each step averages the gradients of that step's members' batches."""
    batches: dict[int, set[tuple[int, int]]] = {}
    for path in log_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            batches.setdefault(entry["step"], set()).add((entry["rank"], entry["world"]))
    model = make_model()
    optimizer = make_optimizer(model)
    x_all, y_all = train_set.tensors
    for step in range(steps):
        members = sorted(batches[step])
        optimizer.zero_grad()
        for rank, world in members:
            index = batch_indices(step, rank, world, len(x_all))
            (nn.functional.cross_entropy(model(x_all[index]), y_all[index]) / len(members)).backward()
        optimizer.step()
    return model


def _die() -> None:
    print("[victim] SIGKILL in the middle of backward", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
