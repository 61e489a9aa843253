"""``GRADSYNC_INSTALL=1`` for scripts that never import gradsync: install at the first ``import torch``.

setup.py puts ``gradsync-autoinstall.pth`` into site-packages (wheel and editable installs
alike). Python runs its one line at every start-up: it reads ``GRADSYNC_INSTALL`` and only
when that is set (not "" or "0") imports this module, so plain start-up costs an environment
look-up.

This module imports neither torch nor gradsync, and does not install yet: while .pth files
run, sys.path may lack the directory torch lives in (a venv processes its own .pth files
before adding the system site-packages it inherits), and a process that never imports torch
(pip, a tool run under the same environment) should not pay for importing it. Instead a
finder waits for the first ``import torch``; once torch's ``__init__`` has run, and before
whoever imported torch continues, gradsync is imported and ``gradsync.install()`` runs. A
framework binds DDP only after importing torch, so it binds gradsync's.
"""

from __future__ import annotations

import sys
from typing import Any


class _InstallAfterTorch:
    """A ``sys.meta_path`` finder for ``torch`` only: torch's loader, then ``gradsync.install()``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        # The finders after this one, as the import system would ask them. Not one-shot:
        # importlib.util.find_spec("torch") (transformers' availability checks) lands here too
        # without executing anything, so the finder stays until torch has actually run.
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenInstall(spec.loader)
                return spec
        return None


class _ThenInstall:
    """Wraps torch's loader: runs torch's ``__init__``, then installs gradsync."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # torch sees its own loader
        self.loader.exec_module(module)
        _install_gradsync()


def _install_gradsync() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _InstallAfterTorch)]
    if "gradsync" in sys.modules:
        return  # gradsync's own import is importing torch; its __init__ installs when it ends
    import gradsync

    gradsync.install()


if "torch" in sys.modules:
    _install_gradsync()
else:
    sys.meta_path.insert(0, _InstallAfterTorch())
