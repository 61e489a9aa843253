"""Constructor arguments of ``DistributedDataParallel``: checked and resolved in one place.

Every argument of torch 2.13's constructor is accepted; those gradsync does not
implement raise ``NotImplementedError`` rather than being silently ignored.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..engine.buckets import bucket_caps_bytes
from ..engine.config import ReducerConfig
from . import synced


def resolve_process_group(process_group: Any, device_mesh: Any) -> dist.ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise RuntimeError(
            "Cannot specify both process_group and device_mesh arguments. Pass one of them to DistributedDataParallel."
        )
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(
                f"Only 1D device mesh is supported, but got a {device_mesh.ndim}-D one; "
                "slice the data-parallel dimension out first (mesh['dp'])."
            )
        group: dist.ProcessGroup = device_mesh.get_group(mesh_dim=0)
        return group
    if not dist.is_initialized():
        raise ValueError(
            "Default process group has not been initialized, please make sure to call init_process_group. "
            "Call torch.distributed.init_process_group() (torchrun sets the environment for it) before "
            "wrapping the model in DistributedDataParallel."
        )
    return process_group if process_group is not None else cast(dist.ProcessGroup, dist.group.WORLD)


def check_parameters(module: nn.Module, named_params: list[tuple[str, nn.Parameter]]) -> None:
    for name, param in module.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                f"Parameter '{name}' is not initialized yet (a lazy module): run one forward pass on a "
                "dummy batch before wrapping the model."
            )
    if not named_params:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter that "
            "requires a gradient: there is nothing to synchronise. Check requires_grad, or do not wrap "
            "this module."
        )
    device_types = {p.device.type for _, p in named_params}
    if len(device_types) > 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but input "
            f"module parameters locate in {sorted(device_types)}. "
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
                f"SyncBatchNorm layers only work with GPU modules: module '{name}' is "
                "torch.nn.SyncBatchNorm on CPU. Use gradsync.convert_sync_batchnorm (which runs on CPU) "
                "or plain BatchNorm."
            )


def resolve_device(
    device_ids: Sequence[Any] | None, output_device: Any, named_params: list[tuple[str, nn.Parameter]]
) -> torch.device | None:
    devices = {p.device for _, p in named_params}
    single_device = len(devices) == 1
    device = next(iter(devices))
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            "device_ids can only be None or contain a single element. "
            f"device_ids={list(device_ids)}: one process driving several devices is not supported "
            "(torch dropped it too). Launch one process per device with torchrun and pass "
            "device_ids=[local_rank]."
        )
    if device.type == "cpu" or not single_device:
        where = "a CPU module" if device.type == "cpu" else "a module spread over several devices"
        for arg, value in (("device_ids", device_ids), ("output_device", output_device)):
            if value is not None:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got "
                    f"{arg}={value!r} for {where}; leave {arg} as None."
                )
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
            stacklevel=3,  # the user's DistributedDataParallel(...) line: warn, this helper, __init__
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


def warn_deprecated(check_reduction: bool) -> None:
    if check_reduction:
        warnings.warn(
            "check_reduction is deprecated and has no effect; gradsync always checks that every parameter was reduced.",
            FutureWarning,
            stacklevel=3,  # the user's DistributedDataParallel(...) line: warn, this helper, __init__
        )


def resolve_delayed(
    named_params: list[tuple[str, nn.Parameter]],
    sparse: list[bool],
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
) -> tuple[frozenset[int], int | None]:
    """(indices of the delayed parameters, index of the hook parameter) in ``named_params``.

    See [Note: delayed all-reduce] in bucket_set.py.
    """
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce must be given together.")
    if delay_all_reduce_named_params is None:
        return frozenset(), None
    index_of = {id(p): i for i, (_, p) in enumerate(named_params)}
    delayed = set()
    for entry in delay_all_reduce_named_params:
        name, param = entry
        if id(param) not in index_of:
            raise ValueError(
                f"delay_all_reduce_named_params names '{name}', which is not a trainable, non-ignored "
                "parameter of the wrapped module; pass (name, parameter) pairs from module.named_parameters()."
            )
        if sparse[index_of[id(param)]]:
            raise ValueError(f"delay_all_reduce_named_params: '{name}' has sparse gradients, which cannot be delayed.")
        delayed.add(index_of[id(param)])
    if id(param_to_hook_all_reduce) not in index_of:
        raise ValueError(
            "param_to_hook_all_reduce must be a trainable, non-ignored parameter of the wrapped module: the "
            "delayed all-reduce starts once its gradient is ready."
        )
    return frozenset(delayed), index_of[id(param_to_hook_all_reduce)]


def check_reduce_dtype(
    reduce_dtype: torch.dtype | None, named_params: list[tuple[str, nn.Parameter]], gradient_as_bucket_view: bool
) -> None:
    if reduce_dtype is None or not gradient_as_bucket_view:
        return
    other = [name for name, p in named_params if p.dtype != reduce_dtype]
    if other:
        raise ValueError(
            f"gradient_as_bucket_view=True cannot be combined with mixed_precision reducing in {reduce_dtype}: "
            f"the .grad of {other[:3]} (dtype {named_params[0][1].dtype}) cannot be a view of a {reduce_dtype} "
            "bucket. Pass gradient_as_bucket_view=False."
        )


def reducer_config(
    module: nn.Module,
    named_params: list[tuple[str, nn.Parameter]],
    caps: list[int],
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    reduce_dtype: torch.dtype | None,
    *,
    find_unused_parameters: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    skip_all_reduce_unused_params: bool,
) -> ReducerConfig:
    """The reducer's settings, checked: sparse parameters, delayed ones, the buckets' dtype."""
    sparse = synced.sparse_flags(module, named_params)
    delayed, delay_after = resolve_delayed(
        named_params, sparse, delay_all_reduce_named_params, param_to_hook_all_reduce
    )
    check_reduce_dtype(reduce_dtype, named_params, gradient_as_bucket_view)
    return ReducerConfig(
        sparse=tuple(sparse),
        caps=tuple(caps),
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        skip_all_reduce_unused_params=skip_all_reduce_unused_params,
        delayed=delayed,
        delay_after=delay_after,
        reduce_dtype=reduce_dtype,
    )
