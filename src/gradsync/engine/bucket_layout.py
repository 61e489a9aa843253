"""Which bucket each parameter is in, and the ways that changes after construction.

The reducer starts with buckets in reverse registration order (a guess at the order backward
makes gradients ready), with the caps the wrapper chose. Three things build them again, each
through ``_build`` so that no two copies of the flat buffers exist at once and the reduction
follows the new buffers:
- the one-time rebuild in the order the first backward really produced gradients ([Note:
  bucket rebuild] in rebuild.py);
- a joiner of the fault-tolerant mode adopting another rank's layout ([Note: a joiner's
  buckets] in elastic/heal.py);
- a reduction that needs padded buffers and no lone gradient reduced in place (a sharded
  optimizer's reduce-scatter, ``Reducer.use_reduction``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .bucket_set import BucketSet
from .config import ReducerConfig
from .rebuild import BucketRebuild
from .reductions import Reduction


class BucketLayout:
    """The reducer's buckets, the caps they are cut with, and the one-time rebuild's progress."""

    def __init__(self, params: Sequence[torch.Tensor], config: ReducerConfig) -> None:
        count = len(params)
        self.caps = list(config.caps)  # what the rebuild uses; a compressing hook may change it (wrapper)
        self._keep_local_grads = config.keep_local_grads  # the fault-tolerant mode: .grad stays local
        self._as_view = config.gradient_as_bucket_view
        # Reducing lone large gradients in place needs no hook; hooks are registered after
        # construction, so the rebuild decides again.
        self.buckets = BucketSet(
            params,
            list(config.sparse),
            list(reversed(range(count))),
            self.caps,
            reduce_lone_in_place=not config.keep_local_grads,
            delayed=config.delayed,
            reduce_dtype=config.reduce_dtype,
            delay_after=config.delay_after,
        )
        self.initial_sizes = [s.nbytes for s in self.buckets.storages]  # torch's logging data reports them
        self.rebuild = BucketRebuild(count, enabled=config.static_graph or not config.find_unused_parameters)

    def describe(self) -> dict[str, Any]:
        """What ``adopt`` needs to build these buckets on another rank."""
        return {"order": list(self.buckets.order), "caps": list(self.caps), "rebuilt": self.rebuild.done}

    def rebuild_in(self, order: list[int], reduction: Reduction) -> None:
        """The one-time rebuild, in the agreed gradient-ready ``order``."""
        self.rebuild.apply()
        self._build(order, reduction)

    def adopt(self, order: list[int], caps: list[int], rebuilt: bool, reduction: Reduction) -> None:
        """Build the buckets another rank has ([Note: a joiner's buckets] in elastic/heal.py)."""
        self.caps = list(caps)
        self.rebuild.adopt(rebuilt)
        self._build(order, reduction)

    def pad_for(self, reduction: Reduction, pad_multiple: int) -> None:
        """The same order again, flat buffers padded to ``pad_multiple`` for ``reduction``; before training,
        so these are the sizes the run starts with."""
        self._build(self.buckets.order, reduction, pad_multiple)
        self.initial_sizes = [s.nbytes for s in self.buckets.storages]

    def _build(self, order: list[int], reduction: Reduction, pad_multiple: int | None = None) -> None:
        """New buckets in ``order``: a lone large gradient is reduced in place only where ``reduction``
        allows it and the fault-tolerant mode does not keep local gradients; the reduction follows."""
        in_place = reduction.reduces_lone_in_place and not self._keep_local_grads
        reduction.before_rebuild()  # what it holds of the old buffers goes first: no two copies at once
        hold = reduction.holds_buckets
        self.buckets = self.buckets.rebuilt(order, self.caps, self._as_view, in_place, pad_multiple, hold)
        reduction.adopt_buckets(self.buckets)
