"""Notice parameters registered into a wrapped module after wrapping.

A parameter added (or replaced) after ``DistributedDataParallel`` built its buckets has
no gradient hook: it would train on local gradients only, silently. torch's global
registration hooks tell us about every ``register_parameter`` / submodule assignment
at no cost to the training step; the wrapper raises at its next forward.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

# id(module) -> (module ref, callback ref); weak so a dead wrapper or module is forgotten.
_watched: dict[int, tuple[weakref.ref[nn.Module], Callable[[], Any]]] = {}
_installed = False


def _notify(module: nn.Module, what: str) -> None:
    entry = _watched.get(id(module))
    if entry is None:
        return
    module_ref, callback_ref = entry
    callback = callback_ref()
    if module_ref() is not module or callback is None:
        _watched.pop(id(module), None)
        return
    callback(module, what)


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    if param is not None:
        _notify(module, name)


def _on_submodule(module: nn.Module, name: str, submodule: Any) -> None:
    if isinstance(submodule, nn.Module) and any(True for _ in submodule.parameters()):
        _notify(module, name)


def watch(root: nn.Module, on_change: Callable[[nn.Module, str], None]) -> None:
    """Call ``on_change(module, name)`` when a parameter or submodule is added under ``root``."""
    global _installed
    if not _installed:
        torch.nn.modules.module.register_module_parameter_registration_hook(_on_parameter)
        torch.nn.modules.module.register_module_module_registration_hook(_on_submodule)
        _installed = True
    callback_ref = weakref.WeakMethod(on_change) if hasattr(on_change, "__self__") else (lambda: on_change)
    for module in root.modules():
        _watched[id(module)] = (weakref.ref(module), callback_ref)
