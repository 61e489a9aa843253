"""Fault-tolerant DiLoCo over islands in tests: one torchrun per island, as the docs launch them.

``IslandJob`` starts each island as ``torchrun --standalone --nproc-per-node S --max-restarts N``
around tests/jobs/diloco_worker.py, with the store hosted here (or etcd). A member killed in its
first incarnation ends its island (its mates exit, [Note: an island member's death, seen by its
mates]); torchrun restarts the island, which the others admit and heal. Each process writes
``<island>-m<member>-r<restart>.{jsonl,json,pt}``; the replay of tests/diloco_elastic_support.py
reads them (a replica is named by its island's first member's uuid).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from diloco_elastic_support import DiLoCoJob

SRC = Path(__file__).parent.parent / "src"


class IslandJob(DiLoCoJob):
    def start_island(self, name: str, slot: int, size: int, restarts: int = 1, **extra: object) -> subprocess.Popen:
        """Island ``name`` (data slot ``slot``) of ``size`` processes under its own torchrun."""
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(size)]
        argv += ["--max-restarts", str(restarts), "--monitor-interval", "0.1", str(self.worker)]
        argv += ["--store", self.address, "--run-id", self.run_id, "--out", str(self.out), "--name", name]
        argv += ["--island", name, "--slot", str(slot)]
        for key, value in {**self.options, **extra}.items():
            argv += [f"--{key.replace('_', '-')}"] + ([str(value)] if value != "" else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
        log = (self.out / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.procs[name]

    def results(self) -> list[dict]:
        """Every process's result that ended its run (the restarted incarnations' included)."""
        return [json.loads(path.read_text()) for path in sorted(self.out.glob("*-m*-r*.json"))]

    def finish_islands(self, names: list[str], timeout_s: float) -> list[dict]:
        """Wait for the islands' torchruns to end well (a restart inside is theirs); every process's result."""
        self.wait_well(names, timeout_s)  # torchrun exits 0 once its workers did, after any restart
        return self.results()


LOST = re.compile(r"^(\S+ \S+) \d+ gradsync\.elastic: island '(\w+)' lost island rank (\d+)", re.MULTILINE)


def island_lost(log: str) -> list[tuple[float, str, int]]:
    """The watch's messages in a torchrun log: (when, island, the lost member's island rank)."""
    found = []
    for when, island, rank in LOST.findall(log):
        stamp = datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        found.append((stamp, island, int(rank)))
    return found


def died_at(out: Path) -> tuple[int, float]:
    """The victim's pid and when it killed (or stopped) itself, as its worker wrote before doing so."""
    pid, when = next(out.glob("*.died")).read_text().split()
    return int(pid), float(when)
