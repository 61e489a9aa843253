"""Running a fault-tolerant job in tests: a store here, trainers as processes, a replay to check them.

``ElasticJob`` hosts the store in the test process (it outlives every trainer, as the launch
recipe asks) and starts ``tests/jobs/elastic_worker.py`` processes. ``replay`` retrains in one
process from the committed-step logs: each committed step averages the gradients of exactly the
batches its members contributed, which is what the survivors' redo promises.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
import elastic_worker  # noqa: E402

from gradsync.elastic import serve  # noqa: E402

WORKER = Path(__file__).parent / "jobs" / "elastic_worker.py"


class ElasticJob:
    worker = WORKER

    def __init__(self, out: Path, run_id: str, **options: object) -> None:
        self.store = serve("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.store.port}"  # what the trainers are given (EtcdJob: etcd://...)
        self.out = out
        self.run_id = run_id
        self.options = options
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, **extra: object) -> subprocess.Popen:
        argv = [sys.executable, str(self.worker), "--store", self.address, "--run-id", self.run_id]
        argv += ["--out", str(self.out), "--name", name]
        for key, value in {**self.options, **extra}.items():
            argv += [f"--{key.replace('_', '-')}"] + ([str(value)] if value != "" else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
        log = (self.out / f"{name}.log").open("w")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.procs[name]

    def wait_arrivals(self, count: int, timeout_s: float = 60) -> None:
        """Until ``count`` trainers have arrived at the store (fixes who becomes rank 0)."""
        deadline = time.monotonic() + timeout_s
        while self.store.add(f"gradsync/elastic/{self.run_id}/arrivals", 0) < count:
            assert time.monotonic() < deadline, f"fewer than {count} trainers arrived"
            time.sleep(0.05)

    def start_with_last_failing(self, healthy: list[str], victim: str, fault: str) -> None:
        """Start ``healthy``, then, once they arrived (so that it gets the last rank), ``victim`` with ``fault``."""
        for name in healthy:
            self.start(name)
        self.wait_arrivals(len(healthy))
        self.start(victim, fault=fault)

    def wait_for_exit(self, name: str, timeout_s: float) -> int:
        return self.procs[name].wait(timeout=timeout_s)

    def wait_stopped(self, name: str, timeout_s: float) -> None:
        """Until process ``name`` is stopped (SIGSTOP): its state in /proc says T."""
        deadline = time.monotonic() + timeout_s
        pid = self.procs[name].pid
        while time.monotonic() < deadline:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            if state == "T":
                return
            time.sleep(0.05)
        raise AssertionError(f"{name} never stopped")

    def finish(self, names: list[str], timeout_s: float) -> list[dict]:
        """Wait for ``names`` to end well; kill everything on a timeout. Their results."""
        self.wait_well(names, timeout_s)
        return [json.loads((self.out / f"{n}.json").read_text()) for n in names]

    def wait_well(self, names: list[str], timeout_s: float) -> None:
        """Wait for the processes ``names`` to exit 0 (else fail with their logs); then kill everything."""
        deadline = time.monotonic() + timeout_s
        try:
            for name in names:
                code = self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
                assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"
        except subprocess.TimeoutExpired:
            logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in names)
            raise AssertionError(f"the job did not finish within {timeout_s}s:\n{logs}") from None
        finally:
            self.kill_all()

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def committed_batches(out: Path) -> dict[int, set[int]]:
    """Step -> the seeds of the batches its members contributed, from every process's log."""
    steps: dict[int, set[int]] = defaultdict(set)
    for path in out.glob("*.jsonl"):
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        for index, entry in enumerate(entries):
            revoked = any(e.get("revoked") == entry.get("step") for e in entries[index + 1 :])
            if "seed" in entry and not revoked:  # a step the others revoked is no committed step
                steps[entry["step"]].add(entry["seed"])
    return dict(steps)


def replay(
    out: Path, steps: int, divisor: int | dict[int, int] | None = None, batches: dict[int, set[int]] | None = None
) -> dict[str, torch.Tensor]:
    """Single-process training on the committed batches (or ``batches``: step -> seeds), step by step.

    Each step averages its batches' gradients, or divides their sum by ``divisor`` (a fixed count,
    or step -> count)."""
    model = elastic_worker.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = committed_batches(out) if batches is None else batches
    assert sorted(batches) == list(range(steps)), f"committed steps have gaps: {sorted(batches)}"
    for step in range(steps):
        seeds = sorted(batches[step])
        count = divisor.get(step, len(seeds)) if isinstance(divisor, dict) else divisor or len(seeds)
        opt.zero_grad()
        # Each member's gradient is that of its own batch (BatchNorm statistics per batch); the
        # update averages them (or divides their sum by a fixed count).
        for seed in seeds:
            x, y = elastic_worker.batch(seed)
            loss = nn.functional.cross_entropy(model(x), y) / count
            loss.backward()
        opt.step()
    return model.state_dict()


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], params_only: bool = True) -> float:
    keys = [k for k in a if not params_only or a[k].is_floating_point() and "running" not in k]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)
