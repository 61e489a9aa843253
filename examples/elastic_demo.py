"""``make demo-elastic``: three replicas of examples/train_elastic_digits.py, one killed and healed.

Hosts the run's store (it outlives every trainer), starts one torchrun per replica (each
restarts only its own replica), has the last rank die mid-backward at step 60, and waits.

``--etcd`` (``make demo-elastic ETCD=1``): the store is a local 3-member etcd cluster instead
(``python -m gradsync.elastic.etcd``; the binary from ``make etcd``), and its leader is SIGKILLed
at step 30 as well, then restarted 5 s later: the replicas go on through both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from gradsync.elastic import serve
from gradsync.elastic.etcd_cluster import LocalCluster

REPLICAS = 3
KILL_AT_STEP = 60
KILL_LEADER_AT_STEP = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etcd", action="store_true", help="a 3-member etcd cluster as the store; kill its leader too")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="gradsync-elastic-"))
    if args.etcd:
        cluster = LocalCluster(3, logs / "etcd").start()
        address = cluster.address
        print(f"store: a 3-member etcd cluster, GRADSYNC_STORE={address}")
        threading.Thread(target=_kill_the_leader, args=(cluster, logs), daemon=True).start()
    else:
        store = serve("127.0.0.1", 0)
        address = f"127.0.0.1:{store.port}"
    env = {
        **os.environ,
        "GRADSYNC_STORE": address,
        "GRADSYNC_REPLICAS": str(REPLICAS),
        "GRADSYNC_RUN_ID": uuid.uuid4().hex[:8],
        "GRADSYNC_DEMO_LOGS": str(logs),
        "OMP_NUM_THREADS": "1",
    }
    script = Path(__file__).with_name("train_elastic_digits.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    replicas = []
    for index in range(REPLICAS):
        extra = ["--kill-at-step", str(KILL_AT_STEP), "--kill-rank", str(REPLICAS - 1)]  # the last rank dies
        command = f"torchrun --standalone --nproc-per-node 1 --max-restarts 3 {script.name} {' '.join(extra)}"
        print(f"replica {index}: {command}")
        replicas.append(subprocess.Popen([*torchrun, "--max-restarts", "3", str(script), *extra], env=env))
    codes = [replica.wait(timeout=600) for replica in replicas]
    print(f"replica exit codes: {codes}")
    if args.etcd:
        cluster.stop()
    return 0 if not any(codes) else 1


def _kill_the_leader(cluster: LocalCluster, logs: Path) -> None:
    """SIGKILL the etcd leader once a replica committed KILL_LEADER_AT_STEP steps; restart it 5 s later."""
    while max((len(p.read_text().splitlines()) for p in logs.glob("*.jsonl")), default=0) < KILL_LEADER_AT_STEP:
        time.sleep(0.05)
    leader = cluster.wait_for_leader()
    cluster.kill(leader)
    killed = time.monotonic()
    print(f"[etcd] SIGKILLed the leader {leader.name} ({leader.endpoint}) at step {KILL_LEADER_AT_STEP}", flush=True)
    new = cluster.wait_for_leader()
    print(f"[etcd] {new.name} leads after {time.monotonic() - killed:.1f}s", flush=True)
    time.sleep(5)
    cluster.start_member(leader)
    print(f"[etcd] {leader.name} restarted: three members again", flush=True)


if __name__ == "__main__":
    sys.exit(main())
