"""``make wheel-check``: gradsync as users get it, a built wheel installed into a fresh environment.

    .venv/bin/python tests/wheel/check_wheel.py [--keep] [--python python3]

Builds the sdist and, from it, the wheel (``python -m build``), checks both (dists.py), makes a
fresh virtual environment outside the checkout, installs the wheel there with every extra (the
frameworks at the versions of constraints-dev.txt, torch from pip's cache or local wheels), and
runs, from a directory outside the checkout so that nothing resolves to src/:

- installed.py: every module imports from site-packages; py.typed, the .pth, the version;
- the digits demo (examples/train_digits.py, 2 processes, 2 epochs, its own checks at the end);
- torch_ddp_script.py, a script for torch's DDP that never imports gradsync: torch's class
  without ``GRADSYNC_INSTALL``, gradsync's with ``GRADSYNC_INSTALL=1`` (2 processes, the .pth) and
  under ``python -m gradsync.run``;
- diloco_round.py: two DiLoCo outer steps over 2 processes;
- fault_tolerant_round.py: a store from ``python -m gradsync.elastic.store`` and two replicas,
  FaultTolerant over DDP and FaultTolerantDiLoCo;
- tests/typing/user_script.py, the typed user's script, in a world of one process;
- mypy over tests/typing against the installed wheel (user_script.py clean, rejected.py's errors
  reported), which finds gradsync's hints only through the wheel's py.typed.

The checks after the install run two at a time (``--jobs``). The temporary directory is removed
when everything passed; ``--keep`` (or a failure) leaves it, and its path is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dists

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
EXTRAS = "examples,plot,integrations,etcd"
GRADSYNC_DDP = "DDP is gradsync.ddp.DistributedDataParallel"
TORCH_DDP = "DDP is torch.nn.parallel.distributed.DistributedDataParallel"
FAULT_TOLERANT_SAYS = {"ddp": "steps committed by both replicas", "diloco": "outer steps, both replicas contributing"}


class CheckFailed(Exception):
    """A check failed; its message says which, and the command's output was written to stderr."""


class Checks:
    """Runs each command from ``work`` (outside the checkout) with the fresh environment's scripts first on PATH."""

    def __init__(self, work: Path, venv: Path) -> None:
        self.work, self.venv = work, venv
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GRADSYNC_INSTALL")}
        env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        self.env = env

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def run(
        self, what: str, command: Sequence[str], expect: Sequence[str] = (), timeout_s: float = 180, **env: str
    ) -> str:
        started = time.monotonic()
        process = subprocess.Popen(
            [str(c) for c in command], cwd=self.work, env={**self.env, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            output = process.communicate(timeout=timeout_s)[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun's workers too
            output = process.communicate()[0] + f"\n(killed after {timeout_s:.0f}s)"
        lacking = [e for e in expect if e not in output]
        if process.returncode != 0 or lacking:
            sys.stderr.write(f"---- {what}\n{output[-6000:]}\n")
            raise CheckFailed(f"{what} failed (exit {process.returncode}; lacking {lacking}): {command}")
        self.timed(what, started)
        return output

    def timed(self, what: str, started: float) -> None:
        print(f"  {time.monotonic() - started:5.1f}s  {what}", flush=True)


def build(dist: Path) -> None:
    command = [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise CheckFailed(f"python -m build failed: {command}")


def install(checks: Checks, python: str, wheel: Path) -> None:
    """A fresh venv, then the wheel with every extra. --no-compile: Python compiles what it imports (torch's
    thousands of modules compiled up front would double the time)."""
    checks.run("python -m venv", [python, "-m", "venv", checks.venv])
    pip = [checks.python, "-m", "pip", "install", "-q", "--no-compile", "-c", REPO / "constraints-dev.txt"]
    checks.run(
        f"pip install gradsync[{EXTRAS}] (constraints-dev.txt)",
        [*pip, f"gradsync[{EXTRAS}] @ {wheel.as_uri()}"],
        timeout_s=600,
    )


def fault_tolerant(checks: Checks, mode: str) -> None:
    """A store from ``python -m gradsync.elastic.store``, two replicas of fault_tolerant_round.py around it."""
    started = time.monotonic()
    store = subprocess.Popen(
        [checks.python, "-m", "gradsync.elastic.store", "--host", "127.0.0.1", "--port", "0"],
        cwd=checks.work, env=checks.env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    replicas: list[subprocess.Popen[str]] = []
    try:
        assert store.stdout is not None
        said = store.stdout.readline()
        port = re.search(r"serving on port (\d+)", said)
        if port is None:
            raise CheckFailed(f"python -m gradsync.elastic.store said {said!r}")
        env = {
            **checks.env,
            "GRADSYNC_STORE": f"127.0.0.1:{port[1]}",
            "GRADSYNC_REPLICAS": "2",
            "GRADSYNC_RUN_ID": mode,
        }
        for _ in range(2):
            replicas.append(
                subprocess.Popen([checks.python, HERE / "fault_tolerant_round.py", mode], cwd=checks.work, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )  # fmt: skip
        outputs = [replica.communicate(timeout=180)[0] for replica in replicas]
        said_so = [FAULT_TOLERANT_SAYS[mode] in output for output in outputs]
        if any(r.returncode != 0 for r in replicas) or not all(said_so):
            sys.stderr.write(f"---- fault-tolerant {mode}\n" + "\n".join(o[-4000:] for o in outputs))
            raise CheckFailed(f"a fault-tolerant {mode} replica failed: {[r.returncode for r in replicas]}")
    finally:
        for process in [*replicas, store]:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
    checks.timed(f"fault-tolerant {mode} round: python -m gradsync.elastic.store + 2 replicas", started)


def after_install(checks: Checks) -> list[Callable[[], object]]:
    """The checks of the installed wheel: the imports of every module first, then the others, longest first."""
    modules = [m.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for m in dists.package_modules(REPO)]
    python = checks.python
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    script, demo = HERE / "torch_ddp_script.py", REPO / "examples" / "train_digits.py"
    # The cache of make typecheck: torch's modules are not checked again (the hashes of their files match).
    cache = ["--cache-dir", REPO / ".mypy_cache", "--config-file", REPO / "pyproject.toml"]
    mypy = [sys.executable, "-m", "mypy", *cache, "--python-executable", python, REPO / "tests" / "typing"]
    run = checks.run
    return [
        lambda: run("every module imports from the wheel; py.typed, .pth", [python, HERE / "installed.py", *modules]),
        lambda: fault_tolerant(checks, "diloco"),
        lambda: fault_tolerant(checks, "ddp"),
        lambda: run("digits demo, 2 processes, 2 epochs", [*torchrun, demo, "--epochs", "2"]),
        lambda: run("GRADSYNC_INSTALL=1 torchrun of the unmodified script: gradsync's class",
                    [*torchrun, script], [f"rank 0: {GRADSYNC_DDP}", f"rank 1: {GRADSYNC_DDP}"], GRADSYNC_INSTALL="1"),
        lambda: run("DiLoCo, 2 processes, 2 outer steps",
                    [*torchrun, HERE / "diloco_round.py"], ["2 outer steps, replicas identical"]),
        lambda: run("typed user script runs", [python, REPO / "tests" / "typing" / "user_script.py"], ["user_script:"]),
        lambda: run("python -m gradsync.run: gradsync's class", [python, "-m", "gradsync.run", script], [GRADSYNC_DDP]),
        lambda: run("torch DDP script, no GRADSYNC_INSTALL: torch's class", [python, script], [TORCH_DDP]),
        lambda: run("mypy: tests/typing against the installed wheel", mypy, ["Success: no issues found in 2 source"]),
    ]  # fmt: skip


def run_in_parallel(checks: Sequence[Callable[[], object]], jobs: int) -> list[str]:
    """Runs every check, ``jobs`` at a time; returns the failures' messages."""
    failures: list[str] = []

    def one(check: Callable[[], object]) -> None:
        try:
            check()
        except (CheckFailed, subprocess.TimeoutExpired) as e:
            failures.append(str(e))

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, checks))
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    parser.add_argument("--python", default="python3", help="the interpreter the fresh environment is made from")
    parser.add_argument("--jobs", type=int, default=2, help="checks run at a time after the install (default: 2)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gradsync-wheel-check-"))
    print(f"wheel-check in {work}", flush=True)
    started = time.monotonic()
    checks = Checks(work, work / "venv")
    try:
        build(work / "dist")
        print(f"  {time.monotonic() - started:5.1f}s  python -m build; {dists.check(work / 'dist', REPO)}", flush=True)
        install(checks, args.python, next((work / "dist").glob("*.whl")))
        first, *rest = after_install(checks)
        first()  # alone: its imports compile torch's and gradsync's modules once, not in every process at once
        failures = run_in_parallel(rest, args.jobs)
    except (CheckFailed, AssertionError, subprocess.SubprocessError) as e:
        failures = [f"{type(e).__name__}: {e}"]
    if failures:
        raise SystemExit("wheel-check failed, " + "\n".join(failures) + f"\n(left {work} to look at)")
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = children.ru_utime + children.ru_stime
    print(f"wheel-check: all passed in {time.monotonic() - started:.0f}s ({cpu:.0f}s of CPU time)", flush=True)
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
