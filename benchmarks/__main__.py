"""The one entry point: ``python -m benchmarks STUDY [--link RATE] [study options ...]``, from the repository root.

With no study (or ``list``, ``-h``, ``--help``) it lists the studies. Otherwise it replaces
itself ([Note: one way to start a study] in lib/launch.py) with the study, started the way the
study needs:

- a study whose ranks are torchrun's (``TORCHRUN``) runs under
  ``torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.STUDY``; with ``--link RATE``
  it is started as ``python -m benchmarks.studies.STUDY`` instead, and starts torchrun inside the
  shaped namespace itself (lib/link.py's ``enter``); with ``-h``/``--help`` it runs as one process,
  which prints its options;
- a launcher that starts its own ranks (``scaling``, ``elastic``, ``zero``) and a single-process study run
  as ``python -m benchmarks.studies.STUDY``.

``OMP_NUM_THREADS`` is 1 unless set, and the repository root is put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from benchmarks.lib import launch

STUDIES_DIR = Path(__file__).resolve().parent / "studies"

TORCHRUN, LAUNCHER, SINGLE = "2 ranks under torchrun", "launcher: starts its own ranks", "single process"

# study -> (how it runs, whether it takes --link, the arguments to show in its command)
STUDIES: dict[str, tuple[str, bool, str]] = {
    "iteration": (TORCHRUN, False, ""),
    "suite": (TORCHRUN, True, ""),
    "sweep": (TORCHRUN, True, ""),
    "parity": (TORCHRUN, True, ""),
    "scaling": (LAUNCHER, True, ""),
    "hooks": (TORCHRUN, True, ""),
    "ab": (TORCHRUN, True, " --before REV --label NAME"),
    "compression_task": (TORCHRUN, True, ""),
    "collective_cost": (TORCHRUN, False, ""),
    "copy_in": (SINGLE, False, ""),
    "product_forms": (SINGLE, False, ""),
    "trace_overhead": (TORCHRUN, False, ""),
    "elastic": (LAUNCHER, False, " {overhead,recovery,all}"),
    "link_chart": (SINGLE, False, " --out PNG SUITE_REPORT..."),
    "zero": (LAUNCHER, True, " {memory,speed}"),
    "etcd": (LAUNCHER, False, " {faults,decide,overhead,all}"),
    "diloco_task": (TORCHRUN, True, " --steps N --seeds S ..."),
    "diloco_faults": (LAUNCHER, False, " --runs 5 --stores tcp,etcd"),
    "diloco_island_faults": (LAUNCHER, False, " --runs 5 --stores tcp,etcd"),
    "gpu_step": (SINGLE, False, ""),
    "gpu_host_profile": (SINGLE, False, ""),
    "gpu_launch_cost": (SINGLE, False, ""),
    "diloco_gpu": (SINGLE, False, " [--tiny]"),
    "hook_cpu": (SINGLE, False, " --before REV --rank R"),
}
HEADLINE = "iteration"  # make bench


def description(study: str) -> str:
    """The first line of the study's docstring, read without importing it (no torch at listing time)."""
    tree = ast.parse((STUDIES_DIR / f"{study}.py").read_text())
    return (ast.get_docstring(tree) or "").splitlines()[0]


def usage() -> str:
    width = max(len(name) for name in STUDIES)
    lines = [
        "usage: python -m benchmarks STUDY [--link RATE] [study options ...]   (from the repository root)",
        "       python -m benchmarks STUDY --help                              (the study's options)",
        "",
        "Each study writes a dated report to benchmarks/results/ (GRADSYNC_BENCH_RESULTS=DIR sends it elsewhere);",
        "benchmarks/README.md has the method, benchmarks/results/README.md the index of reports.",
        "",
        "studies:",
    ]
    for name, (mode, takes_link, args) in STUDIES.items():
        link = " [--link RATE]" if takes_link else ""
        headline = "; `make bench`" if name == HEADLINE else ""
        lines += [
            f"  {name:<{width}}  {description(name)}",
            f"  {'':<{width}}  python -m benchmarks {name}{link}{args}   ({mode}{headline})",
        ]
    lines += [
        "",
        "Exactly: a study of 2 ranks runs as",
        "  OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m benchmarks.studies.STUDY [options]",
        "any other study, and one given --link or --help, as",
        "  OMP_NUM_THREADS=1 python -m benchmarks.studies.STUDY [options]",
        "",
        "--link RATE (1gbit, 2.5gbit, 10gbit, ...): the study runs on a tc-shaped loopback in a private network",
        "namespace (root, iproute2); see benchmarks/README.md.",
    ]
    return "\n".join(lines)


def command(study: str, args: list[str]) -> list[str]:
    """The process that runs ``study`` with ``args`` (see the module docstring)."""
    mode, takes_link, _ = STUDIES[study]
    wants_link = any(a == "--link" or a.startswith("--link=") for a in args)
    if wants_link and not takes_link:
        with_link = ", ".join(name for name, (_, takes, _) in STUDIES.items() if takes)
        raise SystemExit(f"python -m benchmarks {study}: this study has no --link (those that do: {with_link})")
    module = launch.module_of(study)
    wants_help = any(a in ("-h", "--help") for a in args)
    if mode == TORCHRUN and not wants_link and not wants_help:
        return launch.torchrun_m(module, args)
    return launch.python_m(module, args)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(usage())
        return
    study, args = argv[0], argv[1:]
    if study not in STUDIES:
        print(usage(), file=sys.stderr)
        raise SystemExit(f"\npython -m benchmarks: no study {study!r}; choose one of: {', '.join(STUDIES)}")
    argv_out = command(study, args)
    env = launch.env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    sys.stdout.flush()
    os.execve(argv_out[0], argv_out, env)  # signals (Ctrl-C, SIGTERM) go straight to the study or torchrun


if __name__ == "__main__":
    main(sys.argv[1:])
