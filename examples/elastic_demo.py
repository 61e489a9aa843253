"""``make demo-elastic``: three replicas of examples/train_elastic_digits.py, one killed and healed.

Hosts the run's store (it outlives every trainer), starts one torchrun per replica (each
restarts only its own replica), has the last rank die mid-backward at step 60, and waits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from gradsync.elastic import serve

REPLICAS = 3
KILL_AT_STEP = 60


def main() -> int:
    store = serve("127.0.0.1", 0)
    logs = Path(tempfile.mkdtemp(prefix="gradsync-elastic-"))
    env = {
        **os.environ,
        "GRADSYNC_STORE": f"127.0.0.1:{store.port}",
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
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
