"""The digits example under real torchrun: a killed worker, a corrupt checkpoint, two agents.

Every test launches ``torchrun`` (``python -m torch.distributed.run``) on
``examples/train_digits.py`` and compares the final weights it saved (``--save-final``)
bitwise against an uninterrupted run. Dropout is on, so the comparison fails unless each
rank's RNG is restored too, not just the weights and the optimizer.

A launch that times out or fails is killed with every process under it (``_kill_tree``):
torchrun's workers must not outlive a test.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import IO

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_digits.py"
# Two epochs of 22 steps: checkpoints after steps 10 and 20 (mid epoch 1), the crash after
# step 25 (in epoch 2), so resuming has to skip batches and cross an epoch boundary.
TRAIN = ["--epochs", "2", "--dropout", "0.2"]
EVERY, CRASH_AT = 10, 25
LAUNCH_TIMEOUT_S = 75


def _load_example_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checkpointing = _load_example_module("checkpointing")  # for the file-format test


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict[str, str]:
    """This environment without what an enclosing torchrun would have set."""
    launcher = {"RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # a killed or timed-out worker's last words reach the log
    return env


def _process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, parents first (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _kill_tree(process: subprocess.Popen) -> None:
    """Kill torchrun and every process under it.

    Killing torchrun's process group is not enough: it starts each worker in a session of
    its own, and a worker that outlives torchrun keeps the output pipe open. So torchrun is
    stopped first (no new workers while we look), then every process in its tree killed.
    """
    if process.poll() is not None:
        return
    try:
        os.kill(process.pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    for pid in _process_tree(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(*agents: list[str], timeout_s: float = LAUNCH_TIMEOUT_S) -> list[tuple[int, str]]:
    """Run one torchrun per argument list, all at once; (exit code, output) of each.

    Output goes to files, not pipes: two agents of one job must not block each other on a
    full pipe that nobody reads yet.
    """
    logs = [tempfile.TemporaryFile("w+") for _ in agents]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *map(str, argv)],
            cwd=ROOT,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for argv, log in zip(agents, logs)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for process in processes:
            _kill_tree(process)
        pytest.fail(f"torchrun did not finish within {timeout_s}s; its output:\n{_read(logs[0])[-5000:]}")
    finally:  # processes still run here only on a failure (or pytest-timeout's alarm)
        for process in processes:
            _kill_tree(process)
            process.wait()
    return [(process.returncode, _read(log)) for process, log in zip(processes, logs)]


def _read(log: IO[str]) -> str:
    log.seek(0)
    text = log.read()
    log.close()
    return text


def launch_ok(*agents: list[str]) -> str:
    results = launch(*agents)
    for code, out in results:
        assert code == 0, f"torchrun exited with {code}; its output:\n{out[-5000:]}"
    return "\n".join(out for _, out in results)


def standalone(nproc: int, *train_args: object, max_restarts: int = 0) -> list[str]:
    return [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        EXAMPLE,
        *map(str, train_args),
    ]


def assert_same_weights(path: Path, expected_path: Path) -> None:
    actual, expected = torch.load(path, weights_only=True), torch.load(expected_path, weights_only=True)
    assert actual.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"final weights differ from the uninterrupted run in {differ}"


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Final weights and output of the 2-process run nothing happened to (no checkpoints either)."""
    final = tmp_path_factory.mktemp("uninterrupted") / "final.pt"
    return final, launch_ok(standalone(2, *TRAIN, "--save-final", final))


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run: tuple[Path, str]) -> Path:
    return uninterrupted_run[0]


def test_off_a_terminal_the_demo_prints_a_line_per_epoch_not_progress_bars(uninterrupted_run: tuple[Path, str]) -> None:
    """Its output went to a file here, as in CI or through ``| tee``."""
    lines = uninterrupted_run[1].splitlines()
    assert not [line for line in lines if "%|" in line or "it/s]" in line], "progress-bar refreshes in a log"
    epochs = [line for line in lines if line.startswith("epoch ") and "train loss" in line]
    assert [line.split()[1] for line in epochs] == ["1", "2"], lines


@pytest.mark.timeout(180)
def test_killed_worker_is_restarted_and_resumes_bitwise(tmp_path: Path, uninterrupted: Path) -> None:
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    args = [*TRAIN, "--checkpoint-dir", ckpt, "--checkpoint-every", EVERY, "--crash-at-step", CRASH_AT]
    out = launch_ok(standalone(2, *args, "--save-final", final, max_restarts=1))

    assert f"killing myself (SIGKILL) after step {CRASH_AT}" in out
    assert f"resuming from checkpoint {ckpt / 'step-00000020.ckpt'}" in out
    assert_same_weights(final, uninterrupted)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000030.ckpt", "step-00000040.ckpt"]  # the last two


@pytest.mark.timeout(240)
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path: Path, uninterrupted: Path) -> None:
    ckpt, final = tmp_path / "ckpt", tmp_path / "final.pt"
    args = [*TRAIN, "--checkpoint-dir", ckpt, "--checkpoint-every", EVERY]
    # No restart allowed: the crash ends the job, leaving the checkpoints of steps 10 and 20.
    [(code, out)] = launch(standalone(2, *args, "--crash-at-step", CRASH_AT))
    assert code != 0, f"the run should have failed at step {CRASH_AT}; its output:\n{out[-5000:]}"
    newest = ckpt / "step-00000020.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000010.ckpt", newest.name]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a write cut short, as by a full disk

    out = launch_ok(standalone(2, *args, "--save-final", final))

    assert f"checkpoint {newest} is corrupt (payload is" in out
    assert f"resuming from checkpoint {ckpt / 'step-00000010.ckpt'}" in out
    assert (ckpt / "step-00000020.ckpt.corrupt").exists()
    assert_same_weights(final, uninterrupted)


@pytest.mark.timeout(180)
def test_two_agents_c10d_rendezvous_match_one_standalone_agent(tmp_path: Path) -> None:
    """2 nodes x 2 processes through c10d rendezvous on localhost == 1 node x 4 processes."""
    one_node, two_nodes = tmp_path / "one_node.pt", tmp_path / "two_nodes.pt"
    train = ["--epochs", "1", "--dropout", "0.2"]
    launch_ok(standalone(4, *train, "--save-final", one_node))

    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", f"gradsync-{uuid.uuid4().hex[:8]}"]
    agent = [*rendezvous, "--max-restarts", "0", EXAMPLE, *train, "--save-final", two_nodes]
    out = launch_ok(agent, agent)

    assert out.count("replicas identical: True") == 1  # rank 0 prints it; one agent hosts rank 0
    assert "4 ranks" in out
    assert_same_weights(two_nodes, one_node)


@pytest.mark.timeout(30)
def test_checkpoint_file_detects_truncation_and_bit_flips(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(1000.0)}, "step": 3, "rng": (3, tuple(range(10)), None)}
    path = tmp_path / "step-00000003.ckpt"
    checkpointing.write_atomic(path, checkpointing.encode(state))
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    loaded = checkpointing.decode(path.read_bytes())
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["rng"] == state["rng"]

    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[data.find(struct.pack("<f", 500.0)) + 1] ^= 0x01  # w[500]: torch.load alone loads 500.0078
    for bad, why in [
        (data[:-10], "truncated"),
        (bytes(flipped), "sha256"),
        (b"not a checkpoint\n" + data, "header"),
        (b"", "header"),
    ]:
        with pytest.raises(checkpointing.CorruptCheckpoint, match=why):
            checkpointing.decode(bad)

    older = tmp_path / "step-00000001.ckpt"
    checkpointing.write_atomic(older, checkpointing.encode({"step": 1}))
    path.write_bytes(data[:-10])
    found = checkpointing.newest_valid(tmp_path)
    assert found.path == older and found.state == {"step": 1}
    assert [p for p, _ in found.rejected] == [path]
