"""etcd for the tests: the binary ``make etcd`` unpacked, or a skip that prints why there is none.

``make test`` runs ``make etcd`` first: Debian's ``etcd-server`` fetched with ``apt-get download``
and unpacked with ``dpkg -x`` into ``.etcd/`` (no system-wide install). Where that failed, the
Makefile left its error in ``.etcd/unavailable`` and every etcd test skips with it as the reason
(``pytest -ra`` prints it in the summary): never silently.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gradsync.elastic.etcd_cluster import LocalCluster, find_binary
from gradsync.elastic.etcd_store import EtcdStore

from elastic_support import ElasticJob

REPO = Path(__file__).parent.parent


def etcd_binary() -> str:
    """The etcd binary, or a pytest skip saying why there is none."""
    binary = find_binary(REPO)
    if binary is None:
        why = REPO / ".etcd" / "unavailable"
        detail = why.read_text().strip()[-500:] if why.is_file() else "`make etcd` was not run"
        pytest.skip(
            f"etcd tests skipped: no etcd binary (GRADSYNC_ETCD_BIN, PATH, .etcd/usr/bin/etcd): {detail}. "
            "`make etcd` (as root: apt-get download etcd-server + dpkg -x) provides one."
        )
    try:
        subprocess.run([binary, "--version"], capture_output=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"etcd tests skipped: {binary} does not run: {error}")
    return binary


def start_cluster(data_dir: Path, size: int = 3, extra_flags: list[str] | None = None) -> LocalCluster:
    cluster = LocalCluster(size, data_dir, etcd_binary(), extra_flags or [])
    try:
        return cluster.start(timeout_s=30)
    except Exception:
        cluster.stop()
        raise


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Three members on loopback, shared by the tests that kill none of them."""
    cluster = start_cluster(tmp_path_factory.mktemp("etcd-shared"))
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_etcd(tmp_path: Path):
    """Three members of this test's own, for a test that kills some."""
    cluster = start_cluster(tmp_path / "etcd")
    yield cluster
    cluster.stop()


class EtcdJob(ElasticJob):
    """An ``ElasticJob`` whose store is ``cluster`` (every trainer is given all its members), running
    tests/jobs/etcd_worker.py; ``cluster=None``: the same trainers around a TCPStore (the reference)."""

    worker = Path(__file__).parent / "jobs" / "etcd_worker.py"

    def __init__(self, out: Path, run_id: str, cluster: LocalCluster | None, **options: object) -> None:
        super().__init__(out, run_id, **options)
        self.cluster = cluster
        if cluster is not None:
            self.store = EtcdStore.from_address(cluster.address, timedelta(seconds=30))
            self.address = cluster.address

    def committed(self, name: str) -> list[dict]:
        path = self.out / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_steps(self, name: str, count: int, timeout_s: float = 60) -> None:
        """Until trainer ``name`` has committed ``count`` steps."""
        deadline = time.monotonic() + timeout_s
        while len(self.committed(name)) < count:
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise AssertionError(
                    f"{name} committed {len(self.committed(name))} < {count} steps:\n{self.log(name)[-3000:]}"
                )
            time.sleep(0.02)

    def worst_gap(self, name: str) -> float:
        """The longest time between two consecutive committed steps of ``name``."""
        times = [entry["t"] for entry in self.committed(name)]
        return max(b - a for a, b in zip(times, times[1:]))
