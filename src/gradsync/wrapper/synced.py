"""What a wrapped module synchronises: its trainable parameters and its buffers, minus ignored names.

torch's DDP reads the names to leave alone from an attribute on the module
(``_set_params_and_buffers_to_ignore_for_model`` writes it); so do we, so code written for
torch's DDP keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def ignore(module: nn.Module, names: Iterable[str]) -> None:
    """Exclude the named parameters and buffers from reduction and broadcast."""
    setattr(module, IGNORE_ATTR, list(names))


def ignored(module: nn.Module) -> set[str]:
    return set(getattr(module, IGNORE_ATTR, ()))


def parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable, not ignored, each shared parameter once, in registration order."""
    ignored = set(getattr(module, IGNORE_ATTR, ()))
    seen: set[int] = set()
    named = []
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or fqn in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            named.append((fqn, param))
    return named


def buffers(module: nn.Module) -> list[torch.Tensor]:
    ignored = set(getattr(module, IGNORE_ATTR, ()))
    return [b for name, b in module.named_buffers() if name not in ignored]


def sparse_flags(module: nn.Module, named_params: list[tuple[str, nn.Parameter]]) -> list[bool]:
    """Which parameters produce sparse gradients (``nn.Embedding``/``EmbeddingBag`` with ``sparse=True``)."""
    sparse_ids = {
        id(sub.weight) for sub in module.modules() if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
    }
    return [id(p) in sparse_ids for _, p in named_params]


@contextmanager
def preserve_version_counters(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Overwrite ``tensors`` in place without bumping their autograd version (equal values, e.g. a broadcast)."""
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    if preserve is None or not tensors:
        yield
        return
    with preserve(tuple(tensors)):
        yield
