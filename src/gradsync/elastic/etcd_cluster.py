"""A local etcd cluster of N members on loopback: for trying the etcd store, the tests and the demo.

``python -m gradsync.elastic.etcd --members 3`` (etcd.py) starts one and prints its address;
tests/conftest.py, examples/elastic_demo.py and the fault benchmark start theirs from here.

The ``etcd`` binary is looked for in ``$GRADSYNC_ETCD_BIN``, then on ``PATH``, then under
``.etcd/usr/bin/etcd`` of the working directory (where ``make etcd`` unpacks Debian's
``etcd-server``). Every member keeps its data in a folder of its own under ``data_dir``; its
flags are etcd's defaults (heartbeat 100 ms, election timeout 1000 ms) unless ``extra_flags``
says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

LOCAL_BINARY = Path(".etcd/usr/bin/etcd")


def find_binary(root: Path | None = None) -> str | None:
    """The etcd binary to run, or None (see the module docstring for where it is looked for;
    ``root``: where to look for ``.etcd/`` instead of the working directory)."""
    named = os.environ.get("GRADSYNC_ETCD_BIN")
    if named:
        return named if Path(named).is_file() else None
    found = shutil.which("etcd")
    if found:
        return found
    local = (root or Path.cwd()) / LOCAL_BINARY
    return str(local.resolve()) if local.is_file() else None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class LocalCluster:
    """``size`` etcd members on 127.0.0.1; ``address`` is what ``elastic.init(store=...)`` takes."""

    size: int = 3
    data_dir: Path | None = None
    binary: str | None = None
    extra_flags: list[str] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)
    _owned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.binary = self.binary or find_binary()
        if self.binary is None:
            raise FileNotFoundError(
                "no etcd binary: set GRADSYNC_ETCD_BIN, put etcd on PATH, or run `make etcd` (it unpacks "
                "Debian's etcd-server into .etcd/)."
            )
        self._owned = self.data_dir is None  # a temp dir of ours: removed by stop()
        self.data_dir = Path(self.data_dir or tempfile.mkdtemp(prefix="gradsync-etcd-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * self.size)
        for index in range(self.size):
            name = f"m{index}"
            self.members.append(
                Member(
                    name, ports[2 * index], ports[2 * index + 1], self.data_dir / name, self.data_dir / f"{name}.log"
                )
            )

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start every member and wait until the cluster has a leader."""
        for member in self.members:
            self.start_member(member)
        self.wait_for_leader(timeout_s)
        return self

    def start_member(self, member: Member) -> None:
        """Start (or restart, keeping its data) one member."""
        peers = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        state = "existing" if member.data_dir.exists() else "new"
        argv = [
            str(self.binary),
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls=http://127.0.0.1:{member.client_port}",
            f"--advertise-client-urls=http://127.0.0.1:{member.client_port}",
            f"--listen-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{member.peer_port}",
            f"--initial-cluster={peers}",
            f"--initial-cluster-state={state}",
            "--initial-cluster-token=gradsync",
            *self.extra_flags,
        ]
        log = member.log.open("a")
        member.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self, member: Member, timeout_s: float = 0.5) -> dict[str, Any] | None:
        """``/v3/maintenance/status`` of one member, or None if it does not answer."""
        request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                answer: dict[str, Any] = json.loads(reply.read())
                return answer
        except (OSError, ValueError):
            return None

    def leader(self) -> Member | None:
        """The member that is leader now (as the live members see it), or None."""
        for member in self.members:
            if not member.alive:
                continue
            status = self.status(member)
            if status and status.get("leader") and status["leader"] == status["header"]["member_id"]:
                return member
        return None

    def wait_for_leader(self, timeout_s: float = 30.0) -> Member:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            dead = [m.name for m in self.members if m.process is not None and m.process.poll() is not None]
            if len(dead) == len(self.members):
                raise RuntimeError(f"every etcd member exited; see the logs in {self.data_dir}")
            time.sleep(0.05)
        raise RuntimeError(f"the etcd cluster elected no leader within {timeout_s:.0f}s; logs in {self.data_dir}")

    def kill(self, member: Member) -> None:
        """SIGKILL one member (its data stays, so ``start_member`` brings it back)."""
        if member.alive:
            process = cast("subprocess.Popen[bytes]", member.process)  # alive: not None
            process.send_signal(signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        """Kill every member; a data folder this cluster made itself goes too (one given to it stays)."""
        for member in self.members:
            self.kill(member)
        if self._owned:
            shutil.rmtree(cast(Path, self.data_dir), ignore_errors=True)  # a Path since __post_init__

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
