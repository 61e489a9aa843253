"""Moving forward inputs onto the module's device, through any container."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def move_to_device(obj: Any, device: torch.device) -> Any:
    """A copy of ``obj`` with every tensor moved to ``device``.

    Walks tuples, lists, dicts, namedtuples and dataclass instances; anything else is
    returned as it is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
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
