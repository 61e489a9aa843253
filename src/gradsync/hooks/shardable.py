"""Which comm hooks a sharded optimizer's reduce-scatter can carry out, and in what dtype.

A comm hook's contract is the whole bucket in, the whole average out; a reduce-scatter has
neither. What a cast-compression hook *means* survives sharding, though: send the bucket in
fp16 or bf16. So a sharded optimizer takes the plain and the cast hooks (gradsync's and
torch's, and torch's built-in ``FP16_COMPRESS``) as the dtype its reduce-scatter and
all-gather send in, summing in the gradients' own precision (engine/reduce_scatter.py). Hooks
that need the whole bucket (PowerSGD's low-rank factors, top-k, int8 with its scales,
``compress_wrapper`` around any of them) cannot work on shards and are refused, named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from . import allreduce, compression

_WIRE_DTYPES: dict[Any, torch.dtype | None] = {
    allreduce.allreduce_hook: None,
    compression.fp16_compress_hook: torch.float16,
    compression.bf16_compress_hook: torch.bfloat16,
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


def shard_wire_dtype(hook: Any, name: str, rank: int) -> torch.dtype | None:
    """The dtype ``hook`` sends in (None: the gradients' own), or a ``ValueError`` naming it."""
    if hasattr(hook, "shard_wire_dtype"):  # a built-in hook (builtin.py)
        dtype: torch.dtype | None = hook.shard_wire_dtype
        return dtype
    try:
        return _WIRE_DTYPES[hook]
    except (KeyError, TypeError):
        pass
    raise ValueError(
        f"Comm hook {name} cannot be applied to a sharded optimizer's reduce-scatter (rank {rank}): it needs the "
        "whole bucket (low-rank factors, top-k, quantisation scales), which ZeRO never holds. Use fp16_compress_hook "
        "or bf16_compress_hook (gradsync's or torch's), which become the dtype the shards are sent in, or train "
        "this model with plain DDP and an unsharded optimizer to use this hook."
    )
