"""Moving forward inputs onto the module's device, through any container.

[Note: host-to-device copies of inputs]
A CPU input is copied to a CUDA device the way torch's DDP does it (``_recursive_to`` in
``torch/distributed/utils.py``): on a side stream of that device, with a blocking ``.to()``, after
which the current stream waits for the side stream and the copy is marked as used on the current
stream (``record_stream``), so the allocator does not hand its memory out while the forward still
reads it. The blocking copy is the point: ``.to(non_blocking=True)`` from pinned memory returns
before the bytes are read, and a data loader that refills the same pinned buffer at once would race
with the copy (wrong inputs, no error). The side stream keeps the copy out of the current stream's
queue; the host waits only for the copy itself. Tensors already on ``device`` are used as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # per CUDA device: the side stream inputs are copied on


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    return stream


def tensor_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU as in [Note: host-to-device copies of inputs]."""
    if tensor.device == device:
        return tensor
    if device.type != "cuda" or tensor.device.type != "cpu" or torch.cuda.is_current_stream_capturing():
        return tensor.to(device)
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        copy = tensor.to(device)  # blocking: the source may be reused once this returns
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    copy.record_stream(current)
    return copy


def move_to_device(obj: Any, device: torch.device) -> Any:
    """A copy of ``obj`` with every tensor moved to ``device``.

    Walks tuples, lists, dicts, namedtuples and dataclass instances; anything else is
    returned as it is.
    """
    if isinstance(obj, torch.Tensor):
        return tensor_to_device(obj, device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(move_to_device(item, device) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(item, device) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, move_to_device(value, device)) for key, value in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            field.name: move_to_device(getattr(obj, field.name), device)
            for field in dataclasses.fields(obj)
            if field.init
        }
        return dataclasses.replace(obj, **changes)
    return obj
