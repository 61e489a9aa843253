"""torch's built-in (C++) hooks, ``dist.BuiltinCommHookType``, as gradsync's Python hooks.

``ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)`` does what torch's
C++ hook does (divide, all-reduce in fp16, cast back) with ``fp16_compress_hook``; the hook is
named after the enum value, as torch's logging data names it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .allreduce import allreduce_hook
from .compression import fp16_compress_hook

# Keyed by name; looked up with whatever ``comm_hook_type.name`` is (None for an unknown object).
_HOOKS: dict[object, Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]] = {
    "ALLREDUCE": allreduce_hook,
    "FP16_COMPRESS": fp16_compress_hook,
}


def builtin_hook(
    comm_hook_type: Any, process_group: dist.ProcessGroup
) -> Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]:
    """The hook for ``comm_hook_type``; it reduces over ``process_group`` whatever state it gets."""
    name = getattr(comm_hook_type, "name", None)
    inner = _HOOKS.get(name)
    if inner is None:
        known = ", ".join(f"BuiltinCommHookType.{n}" for n in _HOOKS)
        raise ValueError(f"Unknown built-in DDP comm hook type {comm_hook_type!r}; expected one of {known}.")

    def hook(_: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        return inner(process_group, bucket)

    hook.__name__ = hook.__qualname__ = f"BuiltinCommHookType.{name}"
    hook.shard_wire_dtype = torch.float16 if name == "FP16_COMPRESS" else None  # type: ignore[attr-defined]
    return hook
