"""Constructor arguments of ``DistributedDataParallel``: checked and resolved in one place.

Every argument of torch 2.13's constructor is accepted; those gradsync does not
implement raise ``NotImplementedError`` rather than being silently ignored.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .buckets import bucket_caps_bytes


def resolve_process_group(process_group: Any, device_mesh: Any) -> dist.ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Pass either process_group or device_mesh to DistributedDataParallel, not both.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(
                f"DistributedDataParallel takes a 1-D device_mesh, got {device_mesh.ndim} dimensions; "
                "slice the data-parallel dimension out first (mesh['dp'])."
            )
        return device_mesh.get_group(mesh_dim=0)
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized. Call torch.distributed.init_process_group() "
            "(torchrun sets the environment for it) before wrapping the model."
        )
    return process_group if process_group is not None else dist.group.WORLD


def check_parameters(module: nn.Module, named_params: list[tuple[str, nn.Parameter]]) -> None:
    for name, param in module.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"Parameter '{name}' is not initialized yet (a lazy module). Run one forward pass "
                "on a dummy batch before wrapping the model in DistributedDataParallel."
            )
    if not named_params:
        raise RuntimeError(
            "DistributedDataParallel got a module with no parameter that requires grad; there is "
            "nothing to synchronise. Check requires_grad, or do not wrap this module."
        )
    device_types = {p.device.type for _, p in named_params}
    if len(device_types) > 1:
        raise ValueError(
            f"DistributedDataParallel needs every parameter on one device type, got {sorted(device_types)}. "
            "Move the whole module to one device (module.to(device)) before wrapping."
        )
    for name, param in named_params:
        if param.is_sparse:
            raise RuntimeError(
                f"Parameter '{name}' is a sparse tensor; DistributedDataParallel only supports dense "
                "parameters (sparse gradients, e.g. nn.Embedding(sparse=True), are fine)."
            )
    for name, sub in module.named_modules():
        if type(sub) is nn.SyncBatchNorm and next(iter(device_types)) == "cpu":
            raise ValueError(
                f"Module '{name}' is torch.nn.SyncBatchNorm, which only runs on GPU. "
                "On CPU use plain BatchNorm or a CPU-capable SyncBatchNorm."
            )


def resolve_device(
    device_ids: Sequence[Any] | None, output_device: Any, named_params: list[tuple[str, nn.Parameter]]
) -> torch.device | None:
    devices = {p.device for _, p in named_params}
    single_device = len(devices) == 1
    device = next(iter(devices))
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids={list(device_ids)}: one process driving several devices is not supported "
            "(torch dropped it too). Launch one process per device with torchrun and pass "
            "device_ids=[local_rank]."
        )
    if device.type == "cpu" or not single_device:
        where = "a CPU module" if device.type == "cpu" else "a module spread over several devices"
        for arg, value in (("device_ids", device_ids), ("output_device", output_device)):
            if value is not None:
                raise ValueError(f"{arg} must be None for {where}, got {value!r}.")
        return None
    if not device_ids:
        return None
    target = torch.device(device.type, device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
    if target != device:
        raise ValueError(
            f"device_ids={list(device_ids)} but the module's parameters are on {device}; "
            "move the module to that device first (module.to(device_ids[0]))."
        )
    return target


def resolve_buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers at construction, sync buffers before forwards), as in torch 2.13."""
    if broadcast_buffers is not None:
        warnings.warn(
            "broadcast_buffers is deprecated (as in torch 2.13); use forward_sync_buffers to control "
            "the per-forward buffer sync. broadcast_buffers=False also skips the sync at construction.",
            FutureWarning,
            stacklevel=4,
        )
    init_sync_buffers = broadcast_buffers is not False
    if forward_sync_buffers is not None:
        return init_sync_buffers, bool(forward_sync_buffers)
    return init_sync_buffers, broadcast_buffers is not False


def resolve_caps(bucket_cap_mb: float | str | None, bucket_cap_mb_list: Sequence[float] | None) -> list[int] | None:
    """Caps in bytes; ``None`` for ``"auto"``, which is measured once the group is known."""
    if bucket_cap_mb == "auto":
        if bucket_cap_mb_list is not None:
            raise ValueError('bucket_cap_mb="auto" and bucket_cap_mb_list cannot be combined; pick one.')
        return None
    if bucket_cap_mb is not None and (not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0):
        raise ValueError(f'bucket_cap_mb must be a positive number of MiB or "auto", got {bucket_cap_mb!r}.')
    if bucket_cap_mb_list is not None and (
        not bucket_cap_mb_list or any(not isinstance(c, (int, float)) or c <= 0 for c in bucket_cap_mb_list)
    ):
        raise ValueError(f"bucket_cap_mb_list must be a non-empty list of positive MiB, got {bucket_cap_mb_list!r}.")
    return bucket_caps_bytes(bucket_cap_mb, bucket_cap_mb_list)


def reject_unsupported(
    *,
    check_reduction: bool,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    skip_all_reduce_unused_params: bool,
) -> None:
    if check_reduction:
        warnings.warn(
            "check_reduction is deprecated and has no effect; gradsync always checks that every parameter was reduced.",
            FutureWarning,
            stacklevel=4,
        )
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce must be given together.")
    unsupported = {
        "delay_all_reduce_named_params": delay_all_reduce_named_params is not None,
        "mixed_precision": mixed_precision is not None,
        "skip_all_reduce_unused_params": bool(skip_all_reduce_unused_params),
    }
    for name, given in unsupported.items():
        if given:
            raise NotImplementedError(
                f"gradsync.DistributedDataParallel does not support {name} yet; leave it at its default "
                "(or use torch.nn.parallel.DistributedDataParallel for this feature)."
            )
