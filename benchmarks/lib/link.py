"""A network link of known speed on one machine: a private namespace with a rate-limited loopback.

On plain loopback an all-reduce is CPU time on the cores backward needs, so overlap cannot
show. Across machines the link is the bottleneck and a collective is waiting. As root, a
network namespace whose loopback goes through a token-bucket filter (``tc ... tbf``) is such a
link: the ranks run inside it and every byte they exchange passes the shaper. Both directions
share the one loopback qdisc, so at 1 Gbit/s a 2-rank all-reduce moves its buffer at about
63 MB/s (measured: 16 MiB in 265 ms). This kernel has no ``netem``, so there is no added
latency, only the rate.

Used by the suite, the scaling study, the hooks, A/B and compression-task studies through
``--link RATE``::

    python -m benchmarks suite --link 1gbit          # starts torchrun inside the namespace
    python -m benchmarks scaling --link 1gbit

``python -m benchmarks scaling --link RATE --per-rank-links`` gives each rank a link of its own
instead of the shared loopback ([Note: one link per rank], ``run_ranks``).

``enter(rate, nproc)`` runs first in the study's ``main``: outside the namespace it creates one
(uniquely named), starts the same study inside it (``python -m benchmarks.studies.NAME``, under
torchrun when ``nproc`` is given; [Note: one way to start a study] in launch.py) and exits with
its status; inside (``GRADSYNC_BENCH_LINK`` set) it returns and the study runs as usual. The
namespace is removed on every exit path: normal end, failure, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from benchmarks.lib import launch

ENV_VAR = "GRADSYNC_BENCH_LINK"  # set inside the namespace: the rate, for reports
TOPOLOGY_VAR = "GRADSYNC_BENCH_LINK_TOPOLOGY"  # "per-rank" when each rank has its own link (see below)
SUBNET = "10.77.0"  # the per-rank links' addresses: rank r is SUBNET.(r + 1)
MTU = "9000"  # jumbo frames, as cluster networks use; 1500 would cost CPU per byte on 2 cores
BURST = "128kb"
LATENCY = "50ms"  # how long a packet may queue in the shaper before it is dropped
_RATE = re.compile(r"^\d+(\.\d+)?(kbit|mbit|gbit)$")


def parse_rate(text: str) -> str:
    """``1gbit``, ``2.5gbit``, ``500mbit``: tc's own spelling, checked before anything is created."""
    rate = text.strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"--link {text!r}: give a rate as tc spells it, e.g. 1gbit, 2.5gbit, 10gbit, 500mbit")
    return rate


def current() -> str | None:
    """The rate of the shaped link this process runs on, or None on plain loopback."""
    return os.environ.get(ENV_VAR) or None


def per_rank() -> bool:
    """Whether this process runs behind a link of its own (``run_ranks``), not the shared loopback."""
    return os.environ.get(TOPOLOGY_VAR) == "per-rank"


def islands() -> str | None:
    """ "islands of N" when ranks share a namespace in groups of N behind one link (``run_ranks``)."""
    topology = os.environ.get(TOPOLOGY_VAR, "")
    return topology if topology.startswith("islands") else None


def shaped_device() -> str:
    """The interface whose qdisc shapes this process's traffic (for tc statistics)."""
    return "eth0" if per_rank() or islands() else "lo"


def describe(rate: str | None = None, one_per_rank: bool | None = None) -> str:
    """One line for reports: which link the numbers were measured on (by default this process's)."""
    rate = current() if rate is None else parse_rate(rate)
    one_per_rank = per_rank() if one_per_rank is None else one_per_rank
    if rate is None:
        return "plain loopback (unshaped: communication is CPU time on the training cores)"
    if islands() is not None:
        return (
            f"{islands()} ranks: each island in its own network namespace (its ranks talk over its loopback, "
            f"unshaped), the islands joined to a bridge by veth pairs shaped to {rate} in each direction "
            f"(tc tbf, burst {BURST}, latency {LATENCY}; MTU {MTU})"
        )
    if one_per_rank:
        return (
            f"one link per rank: each rank in its own network namespace, joined to a bridge by a veth pair "
            f"shaped to {rate} in each direction (tc tbf, burst {BURST}, latency {LATENCY}; MTU {MTU}), "
            "like machines on a switch"
        )
    return f"loopback shaped to {rate} (tc tbf, burst {BURST}, latency {LATENCY}) in a private network namespace"


def missing() -> str | None:
    """What this machine lacks for a shaped link, or None if it has everything."""
    if os.geteuid() != 0:
        return "needs root (to create a network namespace)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs '{tool}' from iproute2 (apt-get install iproute2)"
    name = f"gs-probe-{uuid.uuid4().hex[:8]}"
    try:
        _run(["ip", "netns", "add", name])
    except RuntimeError as error:
        return f"cannot create a network namespace ({error})"
    try:
        _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *_tbf("1gbit")])
    except RuntimeError as error:
        return f"the kernel has no tbf qdisc ({error})"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _tbf(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", BURST, "latency", LATENCY]


def _run(command: Sequence[str]) -> None:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


@contextmanager
def shaped_namespace(rate: str) -> Iterator[str]:
    """A new namespace with its loopback up and shaped to ``rate``; removed on leaving."""
    rate = parse_rate(rate)
    name = f"gs-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _run(["ip", "netns", "add", name])
    try:
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *_tbf(rate)])
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def switched_namespaces(rate: str, ranks: int) -> Iterator[list[str]]:
    """[Note: one link per rank]
    The shared loopback is one bus: every byte of every rank passes one shaper, both directions
    included, so a W-rank ring moves 2 (W - 1) times the gradients through one 1 Gbit/s queue
    and step time grows with W. Separate machines each have a full-duplex link to a switch.
    That is built here: a hub namespace holds a bridge; rank r's namespace holds ``eth0``
    (address SUBNET.(r + 1)), one end of a veth pair whose other end is on the bridge. tbf
    shapes both ends, so each rank sends at ``rate`` and receives at ``rate``. Yields the rank
    namespaces; everything is removed on leaving (deleting a namespace deletes its veth end).
    """
    rate = parse_rate(rate)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:4]}"
    hub, names = f"gs-hub-{tag}", [f"gs-rank{r}-{tag}" for r in range(ranks)]
    created: list[str] = []
    try:
        _run(["ip", "netns", "add", hub])
        created.append(hub)
        _run(["ip", "-n", hub, "link", "add", "br0", "mtu", MTU, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for r, name in enumerate(names):
            _run(["ip", "netns", "add", name])
            created.append(name)
            port = f"port{r}"
            _run(["ip", "link", "add", port, "netns", hub, "mtu", MTU, "type", "veth", "peer", "name", "eth0",
                  "netns", name, "mtu", MTU])  # fmt: skip
            _run(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", name, "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0"])
            _run(["ip", "-n", name, "link", "set", "eth0", "up"])
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
            _run(["tc", "-n", name, "qdisc", "add", "dev", "eth0", "root", *_tbf(rate)])  # what rank r sends
            _run(["tc", "-n", hub, "qdisc", "add", "dev", port, "root", *_tbf(rate)])  # what it receives
        yield names
    finally:
        for name in reversed(created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_ranks(
    rate: str, ranks: int, argv: Sequence[str], env: dict[str, str] | None = None, per_namespace: int = 1
) -> int:
    """Run ``argv`` once per rank, each behind its own link ([Note: one link per rank]); the worst status.

    Each process gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = rank
    0's address) and ``GLOO_SOCKET_IFNAME=eth0``, so ``init_process_group()`` works unchanged.
    On failure of one rank, or an interrupt, the others are stopped before the links go.

    ``per_namespace > 1``: [Note: islands behind one link] - ranks ``i * per_namespace ..`` share
    namespace ``i``. Between themselves they talk to their own ``eth0`` address, which the kernel
    delivers over the namespace's loopback, unshaped (a fast link inside the island); to any other
    namespace every byte passes the two shapers of the veth pairs (the slow link between islands).
    """
    if ranks % per_namespace:
        raise ValueError(f"{ranks} ranks do not split into namespaces of {per_namespace}")
    topology = "per-rank" if per_namespace == 1 else f"islands of {per_namespace}"
    base = dict(os.environ if env is None else env, **{ENV_VAR: parse_rate(rate), TOPOLOGY_VAR: topology})
    base.update(MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT="29500", WORLD_SIZE=str(ranks), GLOO_SOCKET_IFNAME="eth0")
    base.update(LOCAL_WORLD_SIZE=str(per_namespace), TORCHELASTIC_RUN_ID="gradsync-bench")
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    children: list[subprocess.Popen] = []
    try:
        with switched_namespaces(rate, ranks // per_namespace) as names:
            for r in range(ranks):
                name, local = names[r // per_namespace], r % per_namespace
                env_r = dict(base, RANK=str(r), GROUP_RANK=str(r // per_namespace), LOCAL_RANK=str(local))
                children.append(
                    subprocess.Popen(["ip", "netns", "exec", name, *argv], env=env_r, start_new_session=True)
                )
            return _wait_all(children)
    finally:
        for child in children:
            _stop(child)
        signal.signal(signal.SIGTERM, previous)


def _wait_all(children: list[subprocess.Popen]) -> int:
    """Wait for every child; once one fails, give the rest 30 s (a peer may be blocked in a collective)."""
    deadline = None
    while True:
        codes = [c.poll() for c in children]
        if all(code is not None for code in codes):
            return max(codes, key=abs)
        if deadline is None and any(code not in (None, 0) for code in codes):
            deadline = time.monotonic() + 30
        if deadline is not None and time.monotonic() > deadline:
            return next(code for code in codes if code not in (None, 0))
        time.sleep(0.1)


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


def run_inside(rate: str, argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``argv`` inside a fresh namespace shaped to ``rate``; its exit status.

    The child gets its own process group, so an interrupt stops all of it (torchrun and its
    ranks) before the namespace is removed.
    """
    env = dict(os.environ if env is None else env, **{ENV_VAR: parse_rate(rate)})
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        with shaped_namespace(rate) as name:
            child = subprocess.Popen(["ip", "netns", "exec", name, *argv], env=env, start_new_session=True)
            try:
                return child.wait()
            finally:
                _stop(child)
    finally:
        signal.signal(signal.SIGTERM, previous)


def enter(rate: str | None, nproc: int | None) -> None:
    """With ``--link``, make sure this script runs inside a shaped namespace (see the module doc).

    Returns when there is nothing to do (no ``--link``, or already inside); otherwise runs the
    script inside one and exits with its status.
    """
    if rate is None:
        return
    rate = parse_rate(rate)
    if current() is not None:
        if current() != rate:
            raise SystemExit(f"--link {rate}, but this process already runs on a {current()} link")
        return
    if "LOCAL_RANK" in os.environ:
        raise SystemExit(
            f"--link {rate}: start the study with python, not torchrun (it starts torchrun inside the "
            "namespace itself): " + launch.command_line()
        )
    problem = missing()
    if problem:
        raise SystemExit(f"--link {rate}: a shaped link {problem}; plain loopback still works (run without --link).")
    module, args = launch.main_module(), sys.argv[1:]
    script = launch.python_m(module, args) if nproc is None else launch.torchrun_m(module, args, nproc)
    env = launch.env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    raise SystemExit(run_inside(rate, script, env))


def enter_launcher(rate: str | None, per_rank_links: bool) -> None:
    """A launcher's start: with one link per rank, check they can be made (each rank is started behind
    its own); otherwise, with ``--link``, rerun the launcher inside a shaped namespace (``enter``)."""
    if per_rank_links:
        problem = missing()
        if problem:
            raise SystemExit(f"--per-rank-links: a shaped link {problem}; plain loopback still works.")
    else:
        enter(rate, nproc=None)
