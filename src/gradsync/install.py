"""``gradsync.install()``: torch's ``DistributedDataParallel`` builds gradsync's from then on.

For frameworks with no extension point for the DDP class (Accelerate, Lightning, Ignite, the
Hugging Face Trainer): one call, before or after importing them. Launch scripts that never
import gradsync set ``GRADSYNC_INSTALL=1`` instead (src/_gradsync_autoinstall.py), or run the
script through ``python -m gradsync.run`` (run.py).

[Note: what install rebinds, and what it leaves alone]
Code reaches torch's class in two ways:

- by attribute at call time (``torch.nn.parallel.DistributedDataParallel(model)``, as
  Accelerate and Ignite do): install sets that attribute in ``torch.nn.parallel`` and
  ``torch.nn.parallel.distributed``. Modules imported later bind the class through those
  attributes (``from torch.nn.parallel.distributed import DistributedDataParallel``, as
  Lightning does), so they bind gradsync's without being scanned;
- through a module-level name bound at import (``from torch.nn.parallel import
  DistributedDataParallel as DDP``): install scans ``sys.modules`` and rebinds every such
  name, whatever it is called, in modules imported before it.

torch's own modules other than those two keep torch's class, on purpose: they drive torch's
C++-reducer internals (``torch.distributed._composable.replicate`` builds a torch DDP and
uses its private state; ``ddp_zero_hook`` and ``_optimizer_overlap`` reach into its
reducer), or use the class as a registry (``torch._dynamo.convert_frame`` asks
``DistributedDataParallel._get_active_ddp_module()`` for the torch DDP whose buckets its
DDPOptimizer splits graphs at; gradsync never registers there, see ``_active_ddp_module`` in ddp.py).
Their ``isinstance`` checks against torch's class still hold for gradsync's objects, a
subclass. gradsync's own modules are skipped too: ddp.py derives from torch's class.

Caveats: torch DDP objects that exist while installed run torch methods that look the class
up in ``torch.nn.parallel.distributed`` (``join`` checks ``isinstance`` against it), so
build them before install only if they are not used after it. A torch module first imported
while installed (``replicate`` above) binds gradsync's class; import it before install.
``uninstall`` restores what install replaced; modules first imported while installed keep
the gradsync class they bound, as gradsync cannot tell that from a deliberate
``from gradsync import DistributedDataParallel``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import ModuleType
from typing import NamedTuple

import torch.nn.parallel
import torch.nn.parallel.distributed

from .ddp import DistributedDataParallel

logger = logging.getLogger(__name__)

# Set to anything but "" or "0": importing gradsync installs, and so does the first
# ``import torch`` of a process that never imports gradsync (src/_gradsync_autoinstall.py).
ENV_VAR = "GRADSYNC_INSTALL"

# Where torch's class is looked up by attribute; the only torch modules install changes.
_TORCH_HOMES = (torch.nn.parallel.distributed, torch.nn.parallel)
# Top-level packages whose modules install never scans (see the module note).
_SKIPPED_PACKAGES = ("torch", "gradsync")


class _Binding(NamedTuple):
    """A module-level name that held torch's class until install replaced it."""

    module: ModuleType
    name: str
    value: type  # what it held: torch's class, put back by uninstall


_lock = threading.Lock()
_replaced: list[_Binding] | None = None  # None: not installed
_announced = False  # the INFO line is logged once per process, however often install runs


def requested_by_env() -> bool:
    """Whether ``GRADSYNC_INSTALL`` asks for install (set, and not "" or "0")."""
    return os.environ.get(ENV_VAR, "0") not in ("", "0")


def install_from_env() -> None:
    """``install()`` if ``GRADSYNC_INSTALL`` asks for it; gradsync's ``__init__`` calls this."""
    if requested_by_env():
        install()


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return _replaced is not None


def install() -> None:
    """Make torch's ``DistributedDataParallel`` build ``gradsync.DistributedDataParallel``.

    Replaces the class in ``torch.nn.parallel`` and ``torch.nn.parallel.distributed`` and
    every module-level name bound to it in modules already imported (frameworks' ``DDP``
    aliases included). A second call does nothing; ``uninstall()`` undoes it.
    """
    global _replaced, _announced
    with _lock:
        if _replaced is not None:
            return
        torch_ddp = torch.nn.parallel.distributed.DistributedDataParallel
        replaced = [] if torch_ddp is DistributedDataParallel else _bindings_of(torch_ddp)
        for binding in replaced:
            setattr(binding.module, binding.name, DistributedDataParallel)
        _replaced = replaced
        others = [f"{b.module.__name__}.{b.name}" for b in replaced if b.module not in _TORCH_HOMES]
        logger.debug("gradsync.install rebound %s", others)
        if not _announced:
            _announced = True
            logger.info(
                "gradsync: torch.nn.parallel.DistributedDataParallel now builds "
                "gradsync.DistributedDataParallel (%d module names rebound)",
                len(others),
            )


def uninstall() -> None:
    """Undo ``install()``: every name it rebound holds torch's class again.

    A name changed again since install (to something other than gradsync's class) is left
    as it is. Without a preceding ``install()`` this does nothing.
    """
    global _replaced
    with _lock:
        if _replaced is None:
            return
        for binding in reversed(_replaced):
            if vars(binding.module).get(binding.name) is DistributedDataParallel:
                setattr(binding.module, binding.name, binding.value)
        _replaced = None


def _bindings_of(torch_ddp: type) -> list[_Binding]:
    """Every module-level name bound to ``torch_ddp`` that install may rebind."""
    found = [_Binding(home, "DistributedDataParallel", home.DistributedDataParallel) for home in _TORCH_HOMES]
    seen = {id(home) for home in _TORCH_HOMES}
    for module_name, module in list(sys.modules.items()):
        # One module can be listed under two names (__main__ and __mp_main__): scan it once.
        if not isinstance(module, ModuleType) or id(module) in seen:
            continue
        seen.add(id(module))
        if module_name.partition(".")[0] in _SKIPPED_PACKAGES:
            continue
        # vars(), not getattr: lazy modules (transformers) import on attribute access.
        for name, value in list(vars(module).items()):
            if value is torch_ddp:
                found.append(_Binding(module, name, torch_ddp))
    return found
