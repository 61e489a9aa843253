"""The data-parallel setups a benchmark compares, built from one module by name.

``build(name, module, cap)`` returns the model to train and what to call after
``backward()`` (only the naive version needs that). Every contender wraps its own copy
of the same initial weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lib.common import TORCH_DDP
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.naive import NaiveDataParallel

Cap = Any  # MiB as a number, "auto", or (first bucket's MiB, the others' MiB)

DESCRIPTIONS = {
    "gradsync": "gradsync DDP, default arguments (25 MiB buckets, 1 MiB first bucket)",
    "gradsync_best": "gradsync DDP, gradient_as_bucket_view=True and the best bucket_cap_mb of the sweep",
    "gradsync_fused": "gradsync_best's settings, and the SGD step of each bucket run as its all-reduce completes "
    "(ddp._register_fused_optim)",
    "torch_ddp": "torch.nn.parallel.DistributedDataParallel, default arguments",
    "torch_ddp_view": "torch DDP with gradient_as_bucket_view=True",
    "no_comm": "the bare module: each rank trains alone (the floor)",
    "naive": "gradsync.naive.NaiveDataParallel: one blocking all-reduce per parameter after backward",
    "one_allreduce": "after backward, every gradient copied into one flat buffer, one all-reduce, copied back; "
    "no overlap and no buffer broadcast (the floor for a reducer whose communication cannot overlap compute)",
}
CONTENDERS = tuple(DESCRIPTIONS)


def build(name: str, module: nn.Module, cap: Cap = None) -> tuple[nn.Module, Callable[[], None] | None]:
    """``(model, after_backward)`` for contender ``name``; ``cap`` is for ``gradsync_best``."""
    if name == "gradsync":
        return GradsyncDDP(module), None
    if name == "gradsync_best" or name == "gradsync_fused" or name.startswith("gradsync_view_"):
        return GradsyncDDP(module, gradient_as_bucket_view=True, **_caps(cap)), None  # fused: see optimizer()
    if name == "torch_ddp":
        return TORCH_DDP(module), None
    if name == "torch_ddp_view":
        return TORCH_DDP(module, gradient_as_bucket_view=True), None
    if name == "no_comm":
        return module, None
    if name == "naive":
        naive = NaiveDataParallel(module)
        return naive, naive.average_gradients
    if name == "one_allreduce":
        return module, OneAllReduce(module)
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def optimizer(name: str, model: nn.Module, lr: float, momentum: float) -> Any:
    """SGD for contender ``name``'s model: ``zero_grad()`` and ``step()`` as the training loop calls them.

    For ``gradsync_fused`` the same SGD runs inside backward, bucket by bucket, and ``step()`` does nothing.
    """
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if name != "gradsync_fused":
        return sgd
    model._register_fused_optim(torch.optim.SGD, lr, momentum=momentum)
    return StepsInBackward(sgd)


class StepsInBackward:
    """The optimizer of a model whose DDP steps it in backward: zero_grad as usual, step() a no-op."""

    def __init__(self, sgd: torch.optim.Optimizer) -> None:
        self.sgd = sgd

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sgd.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        pass


class OneAllReduce:
    """Average every gradient with one all-reduce after backward: no buckets, no hooks, no overlap.

    On a machine where communication and compute share the same cores, overlap buys little
    and this is close to the best a data-parallel step can do; the suite shows how far each
    DDP is from it.
    """

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.flat = torch.empty(sum(p.numel() for p in self.params))
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def __call__(self) -> None:
        grads = [p.grad for p in self.params]
        torch._foreach_copy_(self.views, grads)
        self.flat.div_(dist.get_world_size())
        dist.all_reduce(self.flat)
        torch._foreach_copy_(grads, self.views)


def sweep_name(cap: Cap) -> str:
    if isinstance(cap, tuple):  # a first bucket's cap and the others' (bucket_cap_mb_list)
        return f"gradsync_view_{cap[0]:g}+{cap[-1]:g}MiB"
    return f"gradsync_view_{cap}" if cap == "auto" else f"gradsync_view_{cap:g}MiB"


def _caps(cap: Cap) -> dict[str, Any]:
    """DDP keyword arguments for a swept cap."""
    return {"bucket_cap_mb_list": list(cap)} if isinstance(cap, tuple) else {"bucket_cap_mb": cap}


def auto_cap_supported() -> bool:
    """Whether this gradsync accepts ``bucket_cap_mb="auto"`` (every rank must call this)."""
    try:
        GradsyncDDP(nn.Linear(2, 2), bucket_cap_mb="auto")
    except (TypeError, ValueError, NotImplementedError):
        dist.barrier()
        return False
    return True
