"""The plain hook: average each bucket with one all-reduce, as gradsync does without a hook.

Also the pieces every other hook reuses: how a hook's ``state`` names its process group
and its ``WireStats``, and an all-reduce whose future yields the averaged tensor.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .wire import WireStats

GroupOrState = Union[dist.ProcessGroup, None, "AllReduceState"]


class AllReduceState:
    """State for ``allreduce_hook``, ``fp16_compress_hook`` and ``bf16_compress_hook``.

    Pass it instead of a bare process group when you want ``wire`` to record the bytes
    each iteration sent. Any object with ``process_group`` and ``wire`` attributes works.
    """

    __slots__ = ("process_group", "world_size", "wire")

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.wire = WireStats(self.world_size)


def resolve(state: Any) -> tuple[dist.ProcessGroup | None, int, WireStats | None]:
    """``(process_group, world_size, wire)`` from a process group, ``None`` or a state object."""
    if state is None or isinstance(state, dist.ProcessGroup):
        return state, dist.get_world_size(state), None
    if not hasattr(state, "process_group"):
        raise TypeError(
            f"comm hook state must be a ProcessGroup, None (the default group) or a state object with a "
            f"'process_group' attribute such as gradsync.hooks.AllReduceState; got {type(state).__name__}."
        )
    group = state.process_group
    return group, dist.get_world_size(group), getattr(state, "wire", None)


def end_bucket(wire: WireStats | None, bucket: GradBucket) -> None:
    """Close the iteration's byte count once the last bucket of a backward was launched."""
    if wire is not None and bucket.is_last():
        wire.end_iteration()


def first_tensor(fut: torch.futures.Future[Any]) -> torch.Tensor:
    """The tensor a collective's future yields (process groups wrap it in a one-element list)."""
    value = fut.value()
    tensor: torch.Tensor = value[0] if isinstance(value, list) else value
    return tensor


def allreduce_future(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    wire: WireStats | None,
    *,
    divide: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over the group; the future yields the average.

    Divides *before* summing: a sum of ``W`` fp16 gradients can overflow where their
    average cannot. A dense tensor is divided and reduced in place; a sparse one cannot be,
    and the average comes back as a new tensor. ``divide=False`` when the caller already
    divided.
    """
    if divide and tensor.is_sparse:
        tensor = tensor / world_size
    elif divide:
        tensor.div_(world_size)
    if wire is not None:
        wire.add_all_reduce(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(first_tensor)
    return future


def allreduce_hook(process_group_or_state: GroupOrState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one all-reduce: exactly what gradsync does with no hook.

    When to use it: as the baseline every compressing hook is measured against, or as
    the inner hook of ``compress_wrapper``. It is lossless and needs no tuning; the only
    knob is the bucket size (``bucket_cap_mb``), which trades fewer, larger collectives
    against later overlap with the backward pass.

    Bytes on the wire per rank: ``2 (W - 1) / W`` times the bucket's size in its own dtype.

    ``process_group_or_state`` is a ``ProcessGroup``, ``None`` (the default group) or an
    ``AllReduceState`` (or any object with ``process_group`` and ``wire``), whose ``wire``
    then records the bytes sent per iteration.
    """
    group, world_size, wire = resolve(process_group_or_state)
    fut = allreduce_future(bucket.buffer(), group, world_size, wire)
    end_bucket(wire, bucket)
    return fut
