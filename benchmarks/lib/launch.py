"""How a study is started, and started again: always as a module, ``python -m benchmarks.studies.NAME``.

[Note: one way to start a study]
Studies start processes of themselves: torchrun's ranks, the same command inside a shaped
namespace (``link.enter``), the suite's RSS children (``rss.spawn_all``), the scaling study's
workers, the elastic study's replicas. Every one of them is started as a module
(``python -m benchmarks.studies.NAME``, or ``torchrun ... -m benchmarks.studies.NAME``) with the
repository root first on ``PYTHONPATH`` (``env``), so ``benchmarks`` imports as a package whatever
the working directory, and relative paths in a study's arguments keep their meaning.
``python -m benchmarks STUDY`` (``benchmarks/__main__.py``) starts the first process that way too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "benchmarks.studies"
NPROC = 2  # ranks of the studies that run under torchrun


def env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with the repository root first on PYTHONPATH."""
    result = dict(os.environ if base is None else base, **extra)
    paths = [str(REPO), *(p for p in result.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO))]
    result["PYTHONPATH"] = os.pathsep.join(paths)
    return result


def module_of(study: str) -> str:
    return f"{PACKAGE}.{study}"


def python_m(module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m MODULE ARGS`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def torchrun_m(module: str, args: Sequence[str] = (), nproc: int = NPROC) -> list[str]:
    """``torchrun --standalone --nproc-per-node NPROC -m MODULE ARGS`` with this interpreter."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*run, "-m", module, *args]


def main_module() -> str:
    """The dotted name this process was started as (``python -m`` or ``torchrun -m``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name.startswith(PACKAGE + "."):
        raise SystemExit(
            "start a study as a module from the repository root: python -m benchmarks STUDY (or torchrun ... -m "
            "benchmarks.studies.STUDY); python -m benchmarks lists them"
        )
    return spec.name


def study() -> str:
    """This process's study, e.g. ``suite``."""
    return main_module().rsplit(".", 1)[-1]


def command_line(args: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, for reports: ``python -m benchmarks STUDY ARGS``."""
    return " ".join(["python -m benchmarks", study(), *(sys.argv[1:] if args is None else args)])
