"""An optimizer stepped bucket by bucket, as each bucket's reduction completes.

[Note: stepping as buckets complete]
``ddp._register_fused_optim(torch.optim.SGD, lr, momentum=0.9)`` (torch's name and signature)
moves the optimizer into backward: at the end of backward the reducer waits for the buckets in
order, and right after writing a bucket's averages to ``.grad`` it steps that bucket's
parameters, while the later buckets' collectives are still on the wire. On a link slower than
compute, that hides the optimizer behind the tail of the communication. Do not call
``optimizer.step()`` for these parameters yourself (``optim_params`` chooses a subset; step the
rest as usual).

One optimizer instance of the given class per bucket, over the bucket's selected parameters,
built on first use and again when the buckets are rebuilt, carrying each parameter's state (the
momentum buffer, Adam's moments) across. The update is the optimizer's own per-parameter math, so
it is the same as stepping one optimizer after backward. Unlike torch's version it composes with
comm hooks and with ``no_sync`` (accumulating backwards step nothing; the synced one steps).
``fused_optimizer.set_lr(lr)`` changes the learning rate of every instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .bucket_set import BucketSet


class FusedOptimizer:
    def __init__(
        self,
        optim_cls: type[torch.optim.Optimizer],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        params: Sequence[torch.Tensor],
        optim_params: Iterable[torch.Tensor] | None,
    ) -> None:
        if not (isinstance(optim_cls, type) and issubclass(optim_cls, torch.optim.Optimizer)):
            raise TypeError(f"_register_fused_optim needs a torch.optim.Optimizer class, got {optim_cls!r}.")
        wrapped = {id(p) for p in params}
        chosen = list(params) if optim_params is None else list(optim_params)
        outside = [i for i, p in enumerate(chosen) if id(p) not in wrapped]
        if outside:
            raise ValueError(
                f"optim_params holds {len(outside)} tensor(s) (positions {outside[:5]}) that are not parameters "
                "this DistributedDataParallel reduces; pass parameters of the wrapped module only."
            )
        self.optim_cls, self.args, self.kwargs = optim_cls, args, kwargs
        self.selected = {id(p) for p in chosen}
        self.per_bucket: list[torch.optim.Optimizer | None] = []
        self._built_for: BucketSet | None = None
        self._lr: Any = None
        optim_cls(chosen, *args, **kwargs)  # fail now, in the caller's frame, on bad arguments

    def step_bucket(self, buckets: BucketSet, b: int) -> None:
        """Step bucket ``b``'s parameters (their ``.grad`` holds the averages)."""
        if self._built_for is not buckets:
            self._build(buckets)
        optimizer = self.per_bucket[b]
        if optimizer is not None:
            optimizer.step()

    def set_lr(self, lr: Any) -> None:
        self._lr = lr
        for optimizer in self.per_bucket:
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr

    def _build(self, buckets: BucketSet) -> None:
        state: dict[torch.Tensor, Any] = {}
        for optimizer in self.per_bucket:
            if optimizer is not None:
                state.update(optimizer.state)
        self.per_bucket = []
        for storage in buckets.storages:
            params = [p for p in storage.params if id(p) in self.selected]
            optimizer = self.optim_cls(params, *self.args, **self.kwargs) if params else None
            if optimizer is not None:
                for p in params:
                    if p in state:
                        optimizer.state[p] = state[p]
            self.per_bucket.append(optimizer)
        self._built_for = buckets
        if self._lr is not None:
            self.set_lr(self._lr)
