"""What the wrapper resolved from its constructor arguments for one reducer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReducerConfig:
    """The reducer's settings; a new reducer (``set_static_graph``, a new process group) gets a replaced copy."""

    sparse: tuple[bool, ...]  # per parameter: produces sparse gradients (nn.Embedding(sparse=True))
    caps: tuple[int, ...]  # bucket caps in bytes: bucket 0, 1, ...; the last applies to the rest
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    skip_all_reduce_unused_params: bool = False
    delayed: frozenset[int] = frozenset()  # delay_all_reduce_named_params ([Note: delayed all-reduce])
    delay_after: int | None = None  # param_to_hook_all_reduce's index
    reduce_dtype: torch.dtype | None = None  # mixed_precision: the buckets' dtype
    # The fault-tolerant mode's reduction ([Note: a step is decided before it is written] in tolerance.py).
    keep_local_grads: bool = False
