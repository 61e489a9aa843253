"""One trainer of a fault-tolerant run whose store is an etcd cluster (tests/test_etcd_faults.py, the fault benchmark).

The model, batches and digests are tests/jobs/elastic_worker.py's, so ``elastic_support.replay``
retrains the committed steps. Every committed step appends ``{"step", "seed", "t", "digest",
"requests"}`` to ``<out>/<name>.jsonl`` (``t``: the wall clock after the step; ``digest``: of the
parameters and optimizer state; ``requests``: etcd requests the training thread sent so far); at
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
    requests = _count_requests(run.store)
    log = (out / f"{args.name}.jsonl").open("a")
    current = {"step": -1, "seed": -1}
    optimizer_step = opt.step

    def logged_step() -> None:  # FaultTolerant steps the optimizer only for a committed step
        optimizer_step()
        digest = sha256_of(ddp.module, opt)[:16]  # equal on every replica after every step: no divergence
        log.write(json.dumps({**current, "t": time.time(), "digest": digest, "requests": requests[0]}) + "\n")
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


def _count_requests(store: object) -> list[int]:
    """A counter of the etcd requests this (the training) thread sends from now on; [0] on a TCPStore."""
    counted, real, me = [0], getattr(store, "_call", None), threading.current_thread()
    if real is None:
        return counted

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if threading.current_thread() is me:
            counted[0] += 1
        return real(*args, **kwargs)

    store._call = call
    return counted


if __name__ == "__main__":
    main()
