"""One trainer of a fault-tolerant run whose store is an etcd cluster (tests/test_etcd_faults.py, the fault benchmark).

The model, batches and digests are tests/jobs/elastic_worker.py's, so ``elastic_support.replay``
retrains the committed steps. Every committed step appends ``{"step", "seed", "t", "digest",
"requests"}`` to ``<out>/<name>.jsonl`` (``t``: the wall clock after the step; ``digest``: of the
parameters and optimizer state; ``requests``: etcd requests the training thread sent so far, but
for those a committing step may send by design, counted in ``excused``: see ``_count_requests``); at
the end ``<name>.json`` holds the digest and the history, and ``<name>.pt`` the weights. An error
(the store lost its quorum, say) is written to ``<name>.error`` and ends the process with 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from elastic_worker import batch, make_model, seed_of, sha256_of, write_result  # noqa: E402

from gradsync import DistributedDataParallel as DDP  # noqa: E402
from gradsync import elastic  # noqa: E402
from gradsync.elastic.step_decision import StepDecider  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--final-world", type=int, default=0, help="also run until the world has this size")
    p.add_argument("--sleep", type=float, default=0.02)
    p.add_argument("--store-timeout", type=float, default=60.0, help="elastic.init(join_timeout_s=)")
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    try:
        train(args, out)
    except Exception as error:  # noqa: BLE001 - the test reads what went wrong
        (out / f"{args.name}.error").write_text(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        os._exit(3)  # no atexit: the store that would be told is the one that failed


def train(args: argparse.Namespace, out: Path) -> None:
    run = elastic.init(
        store=args.store, run_id=args.run_id, replicas=args.replicas, timeout_s=5.0,
        heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=args.store_timeout,
    )  # fmt: skip
    ddp = DDP(make_model(), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ft = elastic.FaultTolerant(ddp, opt)
    requests, excused = _count_requests(run.store, ft.decider)
    log = (out / f"{args.name}.jsonl").open("a")
    current = {"step": -1, "seed": -1}
    optimizer_step = opt.step

    def logged_step() -> None:  # FaultTolerant steps the optimizer only for a committed step
        optimizer_step()
        digest = sha256_of(ddp.module, opt)[:16]  # equal on every replica after every step: no divergence
        entry = {**current, "t": time.time(), "digest": digest, "requests": requests[0], "excused": excused[0]}
        log.write(json.dumps(entry) + "\n")
        log.flush()

    opt.step = logged_step
    while ft.step_count < args.steps or ft.world_size < args.final_world:
        step = ft.step_count
        seed = seed_of(step, ft.rank, ft.world_size)
        x, y = batch(seed)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        current.update(step=step, seed=seed)
        ft.step()
        time.sleep(args.sleep)
    write_result(out, args.name, ddp, opt, ft, run.history)


def _count_requests(store: object, decider: StepDecider | None = None) -> tuple[list[int], list[int]]:
    """Counters of the etcd requests this (the training) thread sends from now on ([0] on a TCPStore):
    those a committing step may send by design are counted apart, as excused. They are the store check
    of a wait on the group that outlasts a slice (a peer is late: is anyone settling?), and the wait
    for the store after a vote that said some member's heartbeats went unanswered ([Note: commit])."""
    counted, excused, real, me = [0], [0], getattr(store, "_call", None), threading.current_thread()
    if real is None:
        return counted, excused
    inside = [False]

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if threading.current_thread() is me:
            (excused if inside[0] else counted)[0] += 1
        return real(*args, **kwargs)

    def excusing(method):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            inside[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                inside[0] = False

        return run

    store._call = call
    if decider is not None:
        decider._check_peers = excusing(decider._check_peers)
        decider.wait_for_a_silent_store = excusing(decider.wait_for_a_silent_store)
    return counted, excused


if __name__ == "__main__":
    main()
