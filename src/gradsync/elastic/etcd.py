"""``python -m gradsync.elastic.etcd --members 3``: a local etcd cluster to try the replicated store with.

Starts ``--members`` etcd processes on 127.0.0.1 (etcd_cluster.py; the binary from
``$GRADSYNC_ETCD_BIN``, ``PATH`` or ``.etcd/``, which ``make etcd`` fills), prints the address to
give ``GRADSYNC_STORE``, and stops them on Ctrl-C. ``--kill-leader-after S`` SIGKILLs the leader
once, S seconds after the start, and restarts it 5 s later (to watch a run survive it). On several
machines run etcd itself on each (docs/fault_tolerance.md, "A store that survives losing a
machine"). ``gradsync.elastic`` does not import this module, so ``python -m`` runs it fresh.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from .etcd_cluster import LocalCluster


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start a local etcd cluster for gradsync's fault-tolerant mode.")
    parser.add_argument("--members", type=int, default=3, help="how many etcd members (3 or 5 tolerate 1 or 2 losses)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the members keep their data and logs (default: a temp dir, removed at exit)",
    )
    parser.add_argument("--kill-leader-after", type=float, default=0.0, help="SIGKILL the leader once, after S seconds")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.members, args.data_dir).start()
    print(f"etcd cluster of {args.members} members, data and logs in {cluster.data_dir}", flush=True)
    print(f"GRADSYNC_STORE={cluster.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        if args.kill_leader_after > 0 and not done.wait(args.kill_leader_after):
            leader = cluster.wait_for_leader()
            cluster.kill(leader)
            print(f"SIGKILLed the leader {leader.name} ({leader.endpoint})", flush=True)
            if not done.wait(5.0):
                cluster.start_member(leader)
                print(f"restarted {leader.name}", flush=True)
        done.wait()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
