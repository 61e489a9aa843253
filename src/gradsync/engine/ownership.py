"""Which reducer hooks a parameter, and letting go of the hooks of a wrapper that is gone.

[Note: discarded wrappers]
Frameworks build a new DistributedDataParallel for every ``fit`` and drop the old one
without a word (Lightning's teardown), and users re-wrap a model after changing it. A
gradient hook that held its reducer strongly would keep the old reducer alive and
reducing forever: two all-reduces per parameter after a second ``fit``, or a hang when
the ranks disagree on how many wrappers they hold. So:

- a hook holds its reducer weakly, and the hooks are removed when the reducer is
  garbage-collected (``weakref.finalize``);
- a reducer built over parameters another live reducer hooks *replaces* it: the old one's
  hooks are removed at once and it is marked retired, so its wrapper refuses the next
  forward with a message instead of training on parameters it no longer reduces.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

# id(parameter) -> (weak parameter, weak owner); checked against the parameter itself,
# so an id reused by a new tensor after the old one died is not mistaken for it.
_owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def _weak_hook(owner_ref: weakref.ref[Any], index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        owner = owner_ref()
        if owner is not None:
            owner._on_grad_accumulated(index, param)

    return hook


class GradHooks:
    """One reducer's post-accumulate-grad hooks; they die with the reducer or on ``remove``."""

    def __init__(self, owner: Any, params: Sequence[torch.Tensor]) -> None:
        owner_ref = weakref.ref(owner)
        self.handles = [p.register_post_accumulate_grad_hook(_weak_hook(owner_ref, i)) for i, p in enumerate(params)]
        self._finalizer = weakref.finalize(owner, _remove, self.handles)

    def remove(self) -> None:
        self._finalizer()  # runs _remove once; later calls and the reducer's death do nothing


def claim(owner: Any, params: Sequence[torch.Tensor]) -> list[Any]:
    """Record ``owner`` as the reducer of ``params``; return the live reducers it replaces."""
    replaced: dict[int, Any] = {}
    for param in params:
        entry = _owners.get(id(param))
        if entry is not None and entry[0]() is param:
            previous = entry[1]()
            if previous is not None and previous is not owner:
                replaced[id(previous)] = previous
        _owners[id(param)] = (weakref.ref(param), weakref.ref(owner))
    if len(_owners) > 4 * len(params) + 1024:  # forget dead entries now and then
        for key, (param_ref, owner_ref) in list(_owners.items()):
            if param_ref() is None or owner_ref() is None:
                del _owners[key]
    return list(replaced.values())
