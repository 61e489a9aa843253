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
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from benchmarks.lib.common import TORCH_DDP
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import hooks
from gradsync.naive import NaiveDataParallel

Cap = Any  # MiB as a number, "auto", or (first bucket's MiB, the others' MiB)

DESCRIPTIONS = {
    "gradsync": "gradsync DDP, default arguments (torch's caps, 1 MiB then 25 MiB; eight buckets for a model of "
    "512 KiB or more when a probe finds its collectives wait on a link)",
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

# The sweep's further contenders (studies/sweep.py): every one at the arguments a user gets, except that
# both PowerSGD hooks compress from iteration 2 (torch's default waits 1000 iterations).
TORCH_ONE_BUCKET_MB = 1024  # torch's powerSGD_hook deadlocks on gloo with several buckets (hooks.py's Note)
SWEEP_DESCRIPTIONS = {
    "gradsync_auto": 'gradsync DDP, bucket_cap_mb="auto" (bucket sizes from a latency/bandwidth probe at construction)',
    "gradsync_powersgd_r1": "gradsync DDP (default buckets) + gradsync.hooks.powersgd_hook, rank 1, start_iter=2",
    "gradsync_powersgd_r4": "gradsync DDP (default buckets) + gradsync.hooks.powersgd_hook, rank 4, start_iter=2",
    "torch_powersgd_r1": f"torch DDP + torch's powerSGD_hook, rank 1, start_powerSGD_iter=2, one bucket "
    f"(bucket_cap_mb={TORCH_ONE_BUCKET_MB}: with several it deadlocks on gloo)",
    "torch_powersgd_r4": "torch DDP + torch's powerSGD_hook, rank 4, start_powerSGD_iter=2, one bucket",
    "gradsync_int8": "gradsync DDP (default buckets) + gradsync.hooks.int8_hook (int8 with one scale per bucket, "
    "error feedback)",
    # What a step costs in CPU alone: the same setups over a process group of this rank only, so every collective
    # is a no-op and nothing waits on the link or on the other rank ([Note: the CPU floors] in studies/sweep.py).
    "gradsync_alone": "gradsync DDP with gradsync's default buckets of this shape, over a group of this rank alone "
    "(collectives move no byte): the engine's own CPU per step (hooks, copies, division, write-back)",
    "gradsync_powersgd_r1_alone": "gradsync_powersgd_r1 over a group of this rank alone: the engine's CPU and the "
    "hook's compression arithmetic, no byte on a link",
}
ALONE = ("gradsync_alone", "gradsync_powersgd_r1_alone")
# The A/A control ([Note: the A/A control] in sweep_stats.py): a setup once more, as a contender of its own.
AGAIN = "_again"
SWEEP_DESCRIPTIONS.update(
    {
        f"{name}{AGAIN}": f"a second instance of `{name}`, built from the same weights: the A/A control, put "
        f"through the same per-shape test against `{name}` as gradsync is against it"
        for name in ("torch_ddp", "torch_powersgd_r1")
    }
)
_solo_groups: dict[int, dist.ProcessGroup] = {}


def solo_group() -> dist.ProcessGroup:
    """A gloo group of this rank alone; every rank creates every rank's group, once, in the same order."""
    if not _solo_groups:
        for r in range(dist.get_world_size()):
            group = dist.new_group([r], backend="gloo")
            if r == dist.get_rank():
                _solo_groups[r] = group
    return _solo_groups[dist.get_rank()]


def build(name: str, module: nn.Module, cap: Cap = None) -> tuple[nn.Module, Callable[[], None] | None]:
    """``(model, after_backward)`` for contender ``name``; ``cap`` is for ``gradsync_best``."""
    if name.endswith(AGAIN) and name.removesuffix(AGAIN) in SWEEP_DESCRIPTIONS | DESCRIPTIONS:
        return build(name.removesuffix(AGAIN), module, cap)
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
    if name in SWEEP_DESCRIPTIONS:
        return build_hooked(name, module, cap), None
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS + tuple(SWEEP_DESCRIPTIONS)}")


def build_hooked(name: str, module: nn.Module, caps: Any = None) -> nn.Module:
    """One of ``SWEEP_DESCRIPTIONS``: "auto" caps, a DDP with a compressing comm hook, or one of ``ALONE``.

    ``caps``: for ``gradsync_alone``, the caps in bytes gradsync's defaults chose on the real group (a group
    of one rank would probe a link that is not there)."""
    if name == "gradsync_auto":
        return GradsyncDDP(module, bucket_cap_mb="auto")
    if name == "gradsync_alone":
        return GradsyncDDP(module, process_group=solo_group(), bucket_cap_mb_list=[c / 2**20 for c in caps])
    if name == "gradsync_powersgd_r1_alone":
        ddp = GradsyncDDP(module, process_group=solo_group())
        ddp.register_comm_hook(hooks.PowerSGDState(ddp.process_group, start_iter=2), hooks.powersgd_hook)
        return ddp
    if name == "gradsync_int8":
        ddp = GradsyncDDP(module)
        ddp.register_comm_hook(hooks.Int8State(None), hooks.int8_hook)
        return ddp
    rank = int(name.rsplit("_r", 1)[1])
    if name.startswith("gradsync_powersgd"):
        ddp = GradsyncDDP(module)
        ddp.register_comm_hook(
            hooks.PowerSGDState(None, matrix_approximation_rank=rank, start_iter=2), hooks.powersgd_hook
        )
        return ddp
    torch_ddp = TORCH_DDP(module, bucket_cap_mb=TORCH_ONE_BUCKET_MB)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    torch_ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return torch_ddp


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
