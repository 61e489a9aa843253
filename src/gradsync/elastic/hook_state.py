"""A comm hook's state across a reconfiguration: pointed at the new group, shared with joiners.

[Note: hook state after a reconfiguration]
- Every state names a process group (or ``None``: the default group, which follows the
  generation). One naming the old group is pointed at the new one, and gradsync's states also
  refresh their cached ``world_size``/``rank``.
- What must agree across ranks travels from the heal source: PowerSGD's warm-start ``Q``
  matrices, its iteration count (it decides when compression starts: ranks that disagreed would
  issue collectives of different sizes, which aborts the process) and its random generator.
- Error-feedback residuals are each rank's own. A joiner starts without any. After a step that
  did not commit, every rank clears its residuals: the failed attempt may have updated them on
  some ranks and not on others. That loses one step's worth of compression error, once.
States of other types keep their own memory; only their process group is rebound.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState as TorchPowerSGDState

from ..hooks import BucketMemory
from ..hooks.powersgd import PowerSGDState


def check_supported(state: Any) -> None:
    if state is None or isinstance(state, dist.ProcessGroup) or hasattr(state, "process_group"):
        return
    raise TypeError(
        f"FaultTolerant cannot move a comm hook state of type {type(state).__name__} to a new process group: "
        "the state must be None, a ProcessGroup or an object with a 'process_group' attribute (as torch's "
        "and gradsync's hook states are)."
    )


def rebind(state: Any, group: dist.ProcessGroup) -> Any:
    """The state to use with ``group`` from now on (the same object where it has one)."""
    if isinstance(state, dist.ProcessGroup):
        return group
    if state is None:
        return None
    if state.process_group is not None:
        state.process_group = group
    if isinstance(getattr(state, "world_size", None), int):
        state.world_size = dist.get_world_size(group)
    if isinstance(getattr(state, "rank", None), int):
        state.rank = dist.get_rank(group)
    wire = getattr(state, "wire", None)
    if wire is not None:
        wire.world_size = dist.get_world_size(group)
    return state


def share(state: Any, bucket_count: int) -> dict[str, Any] | None:
    """What every rank's state must agree on, from the heal source (tensors included)."""
    if isinstance(state, TorchPowerSGDState):
        skip = ("process_group", "error_dict")
        return {"torch_powersgd": {slot: getattr(state, slot) for slot in state.__slots__ if slot not in skip}}
    if isinstance(state, PowerSGDState):
        q = {b: state.q_memory.get(b) for b in range(bucket_count) if state.q_memory.get(b) is not None}
        return {"powersgd": {"iter": state.iter, "q": q, "generator": state.generator.get_state()}}
    return None


def adopt(state: Any, shared: dict[str, Any] | None, bucket_params: list[list[torch.Tensor]], reset: bool) -> None:
    """Apply ``shared`` (from ``share`` on the source); ``reset`` clears the residuals too."""
    if shared is not None and "torch_powersgd" in shared:
        for slot, value in shared["torch_powersgd"].items():
            setattr(state, slot, value)
    if shared is not None and "powersgd" in shared:
        values = shared["powersgd"]
        state.iter = values["iter"]
        state.generator.set_state(values["generator"])
        state.q_memory.clear()
        for b, q in values["q"].items():
            state.q_memory.put(b, bucket_params[b], q)
    if reset:
        errors = getattr(state, "error_dict", None)
        if isinstance(errors, dict):
            errors.clear()
        errors = getattr(state, "errors", None)
        if isinstance(errors, BucketMemory):
            errors.clear()
