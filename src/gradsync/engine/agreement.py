"""The small collectives by which ranks agree: which parameters were used, and the bucket order.

Both run outside the per-bucket hot path (the used map once per iteration with
``find_unused_parameters=True``, the order once at the bucket rebuild) and, like every
collective, are checked by the desync detector first when it is on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives.broadcast import broadcast_int_list
from ..observability.desync import DesyncDetector, Position


def agree_on_used(
    used: list[bool], group: dist.ProcessGroup, device: torch.device, desync: DesyncDetector | None, forwards: int
) -> list[bool]:
    """A parameter counts as used when any rank used it since the last synced backward."""
    if desync is not None:
        desync.check(Position("all-reduce of the used-parameter map", forwards, len(used), "torch.int32"))
    flags = torch.tensor(used, dtype=torch.int32)
    if device.type == "cuda":
        # Through pinned memory, so the copy up does not wait for the GPU: the read back below is then the
        # one host synchronisation find_unused_parameters costs per iteration (torch's reducer has one too).
        flags = flags.pin_memory().to(device, non_blocking=True)
    elif flags.device != device:
        flags = flags.to(device)
    dist.all_reduce(flags, group=group)
    return [bool(u) for u in flags.tolist()]


def agree_on_order(
    local: list[int], group: dist.ProcessGroup, device: torch.device, desync: DesyncDetector | None, forwards: int
) -> list[int]:
    """The gradient-ready order rank 0 observed: every rank must build the same buckets."""
    if desync is not None:
        desync.check(Position("broadcast of the bucket order", forwards, len(local), "torch.int64"))
    return broadcast_int_list(local, dist.get_global_rank(group, 0), group, device)


def shadow_used_map(count: int, group: dist.ProcessGroup, device: torch.device) -> tuple[dist.Work, torch.Tensor]:
    """A joined rank's part of ``agree_on_used``: it used nothing. The flags hold the others' map once waited."""
    used = torch.zeros(count, dtype=torch.int32, device=device)
    return dist.all_reduce(used, group=group, async_op=True), used
