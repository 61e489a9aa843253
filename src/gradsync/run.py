"""``python -m gradsync.run script.py args...``: run a training script with gradsync installed.

    torchrun --nproc-per-node 2 -m gradsync.run train.py --epochs 3
    python -m gradsync.run -m my_package.train --epochs 3

``gradsync.install()``, then the script runs as ``__main__`` with ``sys.argv`` and
``sys.path[0]`` as ``python script.py`` would set them. It also sets ``GRADSYNC_INSTALL=1``
for the processes the script starts (``mp.spawn`` workers construct the DDP), which the
start-up hook of a pip-installed gradsync honours (src/_gradsync_autoinstall.py).

The same as ``GRADSYNC_INSTALL=1 torchrun ... train.py`` where that hook is present; this one
needs no .pth file, so it also works under ``python -S`` / ``-I`` or a gradsync on PYTHONPATH.
"""

from __future__ import annotations

import os
import runpy
import sys

from .install import ENV_VAR, install

USAGE = "usage: python -m gradsync.run (script.py | -m module) [args...]"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    os.environ.setdefault(ENV_VAR, "1")
    install()
    if args[0] == "-m":
        sys.argv = args[1:]  # run_module puts the module's file into sys.argv[0]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
