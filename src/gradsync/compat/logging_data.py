"""``ddp._get_ddp_logging_data()``: torch's dict of construction and runtime facts.

Frameworks read a few of its keys (Lightning: ``can_set_static_graph``); tools print the
whole dict. The keys are torch's; only those with a meaning in gradsync are present, and
times are nanoseconds, as in torch. ``ddp.stats()`` is the documented, richer view.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..wrapper.data_parallel import DataParallelWrapper

_ENV_KEYS = {
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
    "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
}


# How torch's logger spells dtypes (C++ type names).
_TORCH_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _joined(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def collect(ddp: DataParallelWrapper) -> dict[str, Any]:
    engine = ddp.engine
    params = engine.params
    stats = ddp.stats()
    named = zip(engine.names, params)
    unused = set(stats.unused_parameters)
    data: dict[str, Any] = {
        "module_name": type(ddp.module).__name__,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "backend_name": str(dist.get_backend(ddp.process_group)),
        "device_ids": "" if ddp.device_ids is None else _joined(ddp.device_ids),
        "output_device": -1 if ddp.output_device is None else int(getattr(ddp.output_device, "index", -1) or 0),
        "is_multi_device_module": 0,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "has_sync_bn": int(bool(ddp._forward_collectives)),
        "bucket_cap_bytes": int(engine.layout.caps[-1]),
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "static_graph": int(ddp.static_graph),
        "join_uneven_inputs": int(ddp._join_config.enable),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "dtypes": _joined(sorted({_TORCH_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
        "bucket_sizes": _joined(engine.layout.initial_sizes),
        "has_rebuilt_buckets": int(engine.rebuilt),
        "num_buckets_reduced": len(engine.buckets.storages),
        "iteration": max(engine.synced_forwards - 1, 0),  # torch: the last synced forward, from 0
        "unused_parameter_size": sum(p.numel() * p.element_size() for n, p in named if n in unused),
        "avg_forward_compute_time": _ns(stats.avg_forward_s),
        "avg_backward_compute_time": _ns(stats.avg_backward_s - stats.avg_exposed_comm_s),
        "avg_backward_comm_time": _ns(stats.avg_comm_s),
        "avg_backward_compute_comm_overlap_time": _ns(max(stats.avg_comm_s - stats.avg_exposed_comm_s, 0.0)),
    }
    if engine.rebuilt:
        data["rebuilt_bucket_sizes"] = _joined(s.nbytes for s in engine.buckets.storages)
        data["rebuilt_per_bucket_param_indices"] = " ".join(_joined(s.param_indices) for s in engine.buckets.storages)
    if engine.iteration > 0 and not ddp.static_graph:
        # torch documents this key as the signal for Lightning's "your model can run with
        # static_graph=True" hint, then often leaves it out (TORCH_DDP_NOTES §1g); always here.
        data["can_set_static_graph"] = int(engine.records.graph_static)
    if engine.reduction.name is not None:
        data["comm_hook"] = engine.reduction.name
    error = engine.records.last_error or ddp._logged_error
    if error is not None:
        data["has_error"] = 1
        data["error"] = error
    for key, variable in _ENV_KEYS.items():
        data[key] = os.environ.get(variable, "N/A")
    return data
