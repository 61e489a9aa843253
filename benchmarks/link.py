"""A network link of known speed on one machine: a private namespace with a rate-limited loopback.

On plain loopback an all-reduce is CPU time on the cores backward needs, so overlap cannot
show. Across machines the link is the bottleneck and a collective is waiting. As root, a
network namespace whose loopback goes through a token-bucket filter (``tc ... tbf``) is such a
link: the ranks run inside it and every byte they exchange passes the shaper. Both directions
share the one loopback qdisc, so at 1 Gbit/s a 2-rank all-reduce moves its buffer at about
63 MB/s (measured: 16 MiB in 265 ms). This kernel has no ``netem``, so there is no added
latency, only the rate.

Used by the suite, the scaling study and the hooks benchmark through ``--link RATE``::

    python benchmarks/suite.py --link 1gbit          # starts torchrun inside the namespace
    python benchmarks/scaling.py --link 1gbit

``enter(rate, nproc)`` runs first in the script's ``main``: outside the namespace it creates one
(uniquely named), starts the same command inside it (under torchrun when ``nproc`` is given)
and exits with its status; inside (``GRADSYNC_BENCH_LINK`` set) it returns and the script runs
as usual. The namespace is removed on every exit path: normal end, failure, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

ENV_VAR = "GRADSYNC_BENCH_LINK"  # set inside the namespace: the rate, for reports
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


def describe() -> str:
    """One line for reports: which link the numbers were measured on."""
    rate = current()
    if rate is None:
        return "plain loopback (unshaped: communication is CPU time on the training cores)"
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
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGTERM)
                    try:
                        child.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        os.killpg(child.pid, signal.SIGKILL)
                        child.wait()
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
            f"--link {rate}: start the script with python, not torchrun (it starts torchrun inside the "
            "namespace itself): python " + " ".join(sys.argv)
        )
    problem = missing()
    if problem:
        raise SystemExit(f"--link {rate}: a shaped link {problem}; plain loopback still works (run without --link).")
    script = [sys.executable, *sys.argv]
    if nproc is not None:
        script = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *sys.argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    raise SystemExit(run_inside(rate, script, env))
