"""What a bucket's collective hands back: waiting for it, and checking a comm hook's result."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist


def failure_message(b: int, hook_name: str | None, error: Exception) -> str:
    what = f"comm hook {hook_name}" if hook_name else "all-reduce"
    return f"{what} failed on bucket {b}: {error}"


def wait_for(pending: Any) -> torch.Tensor | None:
    """A bucket's result once its collective (or comm hook) completed: None for the plain all-reduce."""
    if isinstance(pending, dist.Work):
        pending.wait()  # the default all-reduce: the result is already in the flat bucket
        return None
    value = pending.wait()  # a future from a comm hook
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # raw collective futures yield a one-element list
    return cast("torch.Tensor | None", value)


def check_result(b: int, result: Any, flat: torch.Tensor, hook_name: str | None) -> str | None:
    who = f"comm hook {hook_name}"
    if not isinstance(result, torch.Tensor):
        return f"{who} returned a future of {type(result).__name__} for bucket {b}; it must yield one tensor"
    if result.numel() != flat.numel():
        return (
            f"{who} yielded a tensor of shape {tuple(result.shape)} ({result.numel()} elements) for bucket {b}, "
            f"whose buffer has shape ({flat.numel()},); the result must have the buffer's shape"
        )
    if not (result.is_floating_point() or result.is_complex()):
        return f"{who} yielded dtype {result.dtype} for bucket {b}; expected a floating dtype such as {flat.dtype}"
    return None
