"""benchmarks/lib/link.py: the shaped-link namespace is created and removed on every exit path, and
every benchmark contender still produces identical replicas on a shaped link."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks is a package at the repository root, not installed

from benchmarks.lib import link  # noqa: E402

MISSING = link.missing()
needs_link = pytest.mark.skipif(MISSING is not None, reason=f"a shaped link {MISSING}")


# One TCP exchange between two rank namespaces: the listener on rank 0's address, the client retrying
# until the listener is up.
SERVER = (
    "import socket, sys; c, _ = socket.create_server((sys.argv[1], 29999)).accept(); c.sendall(b'through the switch')"
)
CLIENT = """
import socket, sys, time
for _ in range(50):
    try:
        print(socket.create_connection((sys.argv[1], 29999), timeout=2).recv(64).decode())
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
"""


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_rates_are_checked_before_anything_is_created() -> None:
    assert link.parse_rate("2.5GBit") == "2.5gbit"
    with pytest.raises(ValueError, match="give a rate as tc spells it"):
        link.parse_rate("1 gigabit")


def test_without_root_one_line_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv(link.ENV_VAR, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        link.enter("1gbit", nproc=2)
    message = str(exit_info.value)
    assert "needs root" in message and "plain loopback still works" in message and "\n" not in message


def test_plain_loopback_is_untouched() -> None:
    link.enter(None, nproc=2)  # no --link: returns, creates nothing


@needs_link
@pytest.mark.timeout(60)
def test_namespace_is_shaped_and_removed_even_on_error() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with link.shaped_namespace("1gbit") as name:
            assert name in _namespaces()
            qdisc = subprocess.run(
                ["ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
            ).stdout
            assert re.search(r"tbf .* rate 1Gbit", qdisc), qdisc
            raise RuntimeError("a failure inside")
    assert name not in _namespaces()


@needs_link
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_removes_its_namespace_and_its_processes(sig: signal.Signals) -> None:
    # An unusual duration, so that no other ``sleep`` on the machine is taken for the child.
    code = "from benchmarks.lib import link; link.run_inside('1gbit', ['sleep', '117.25'])"
    # A shell's background job (`make test &`) starts with SIGINT ignored, and Python then never turns
    # SIGINT into KeyboardInterrupt: the runner gets the default disposition, as a terminal gives it.
    runner = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        _interrupt_and_check(runner, sig)
    finally:  # a failed case must not leave its child to the next one
        runner.kill()
        subprocess.run(["pkill", "-f", "^sleep 117.25$"], capture_output=True)


def _interrupt_and_check(runner: subprocess.Popen, sig: signal.Signals) -> None:
    prefix = f"gs-bench-{runner.pid}-"
    deadline = time.monotonic() + 20
    while not any(n.startswith(prefix) for n in _namespaces()):
        assert time.monotonic() < deadline, "the namespace never appeared"
        time.sleep(0.1)
    # Interrupt once the child runs (the runner is then waiting for it): on a loaded machine a fixed
    # pause could land the signal inside the runner's fork of the child, which is not what is tested.
    while not subprocess.run(["pgrep", "-f", "^sleep 117.25$"], capture_output=True).stdout.strip():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    runner.send_signal(sig)
    runner.wait(timeout=30)
    assert not any(n.startswith(prefix) for n in _namespaces())
    sleepers = subprocess.run(["pgrep", "-f", "^sleep 117.25$"], capture_output=True, text=True).stdout.split()
    assert not sleepers, "the child survived its runner"


@needs_link
@pytest.mark.timeout(180)
def test_every_contender_keeps_identical_replicas_on_a_shaped_link(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    job = Path(__file__).resolve().parent / "jobs" / "link_replicas.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    status = link.run_inside("1gbit", [*torchrun, str(job), "--out", str(out)], env)
    assert status == 0
    result = json.loads(out.read_text())
    shaper = result.pop("_shaper")
    sent = int(re.search(r"Sent (\d+) bytes", shaper).group(1))
    assert sent > 1_000_000, f"the traffic did not pass the shaper:\n{shaper}"
    assert set(result) == {
        "gradsync", "gradsync_best", "gradsync_fused", "torch_ddp", "torch_ddp_view", "naive", "one_allreduce"
    }  # fmt: skip
    assert all(result.values()), result


@needs_link
@pytest.mark.timeout(60)
def test_per_rank_links_are_shaped_both_ways_and_removed_even_on_error() -> None:
    """[Note: one link per rank]: a veth pair per rank to a bridge, tbf on both ends."""
    with pytest.raises(RuntimeError, match="inside"):
        with link.switched_namespaces("1gbit", 3) as names:
            hub = next(n for n in _namespaces() if n.startswith("gs-hub-") and n.endswith(names[0][-9:]))
            for r, name in enumerate(names):
                shown = subprocess.run(["ip", "-n", name, "addr", "show", "eth0"], capture_output=True, text=True)
                assert f"{link.SUBNET}.{r + 1}/24" in shown.stdout, shown.stdout
                for namespace, device in ((name, "eth0"), (hub, f"port{r}")):
                    qdisc = subprocess.run(
                        ["tc", "-n", namespace, "qdisc", "show", "dev", device], capture_output=True, text=True
                    ).stdout
                    assert re.search(r"tbf .* rate 1Gbit", qdisc), (namespace, device, qdisc)
            address = f"{link.SUBNET}.1"
            listener = subprocess.Popen(["ip", "netns", "exec", names[0], sys.executable, "-c", SERVER, address])
            reply = subprocess.run(
                ["ip", "netns", "exec", names[2], sys.executable, "-c", CLIENT, address],
                capture_output=True,
                text=True,
                timeout=20,
            )
            listener.wait(timeout=10)
            assert reply.stdout.strip() == "through the switch", reply.stderr
            raise RuntimeError("a failure inside")
    assert not set(names) & _namespaces() and hub not in _namespaces()


@needs_link
@pytest.mark.timeout(180)
def test_every_contender_keeps_identical_replicas_on_per_rank_links(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    job = Path(__file__).resolve().parent / "jobs" / "link_replicas.py"
    before = _namespaces()
    status = link.run_ranks(
        "1gbit", 2, [sys.executable, str(job), "--out", str(out)], dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert status == 0
    assert _namespaces() == before, "a namespace of the run was left behind"
    result = json.loads(out.read_text())
    sent = int(re.search(r"Sent (\d+) bytes", result.pop("_shaper")).group(1))
    assert sent > 1_000_000, "rank 0's traffic did not pass its link's shaper"
    assert len(result) == 7 and all(result.values()), result


@needs_link
@pytest.mark.timeout(180)
def test_default_caps_shrink_for_a_large_model_on_a_slow_link(tmp_path: Path) -> None:
    """[Note: the default caps] in autotune.py: communication that waits on a link overlaps compute."""
    out = tmp_path / "caps.json"
    job = Path(__file__).resolve().parent / "jobs" / "link_default_caps.py"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    status = link.run_inside("1gbit", [*torchrun, str(job), "--out", str(out)], dict(os.environ, OMP_NUM_THREADS="1"))
    assert status == 0
    result = json.loads(out.read_text())
    mib = 1 << 20
    assert len(result["caps"]) == 1 and result["caps"][0] < 25 * mib, result  # not torch's [1 MiB, 25 MiB]
    assert result["identical"]
