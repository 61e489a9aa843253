"""Healing: a member's whole training state, sent to every member of a new generation.

[Note: a joiner's buckets]
Ranks whose buckets differ issue all-reduces of different sizes, and gloo ends the process on a
size mismatch (NOTES, exp3). A joiner may be configured differently (another ``bucket_cap_mb``)
or not yet know the gradient-ready order the others rebuilt their buckets in. So the source's
bucket layout (order, caps, whether it was rebuilt) travels with the state, and every member
builds its reducer from it; nobody recomputes it.

What travels, by collectives on the new group (no file): the model's ``state_dict`` (parameters
and buffers), the optimizer's, the comm hook's shared state, ``extra_state`` objects'
(schedulers, data positions), and the run's counters. First one ``broadcast_object_list`` of a
skeleton: the same nested structure with every tensor replaced by its shape and dtype; then the
tensors themselves in flat coalesced broadcasts (``broadcast_coalesced``). Every member,
the survivors included, loads what arrived, so afterwards all hold the source's exact bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..collectives.broadcast import broadcast_coalesced


class _Slot(NamedTuple):
    position: int  # in the flat list of tensors (not ``index``: that is tuple's method)
    shape: tuple[int, ...]
    dtype: torch.dtype
    # On the host at the source (an optimizer's step counter, DiLoCo's theta_global in pinned memory on a GPU
    # run): received on the host too, so that every rank lays the tensors out in the same chunks per device.
    on_host: bool


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype, value.device.type == "cpu")
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.position]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _slots(value: Any) -> list[_Slot]:
    if isinstance(value, _Slot):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _slots(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _slots(v)]
    return []


def transfer(payload: Any, source: int, group: dist.ProcessGroup, device: torch.device) -> Any:
    """``payload`` (nested dicts/lists with tensors) from global rank ``source``, on every rank.

    The source gets its own payload back; the others get tensors with the source's bits, on ``device``
    (the model's) where the source's were on a device, on the host where its were on the host.
    """
    tensors: list[torch.Tensor] = []
    skeleton = [_strip(payload, tensors) if dist.get_rank() == source else None]
    dist.broadcast_object_list(skeleton, src=source, group=group)
    if dist.get_rank() == source:
        broadcast_coalesced(tensors, source, group)
        return payload
    slots = sorted(_slots(skeleton[0]), key=lambda s: s.position)
    received = [torch.empty(s.shape, dtype=s.dtype, device="cpu" if s.on_host else device) for s in slots]
    broadcast_coalesced(received, source, group)
    return _fill(skeleton[0], received)


def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what ``transfer`` delivered into the model (all of it, or its buffers) and the optimizer."""
    with torch.no_grad():
        own = module.state_dict(keep_vars=True)
        for name, value in state["model"].items():
            own[name].copy_(value)  # in place: parameters stay the objects the buckets and optimizer hold
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
