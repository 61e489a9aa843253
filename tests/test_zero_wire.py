"""What a sharded optimizer sends in: ``mixed_precision``'s reduce_dtype, or a cast hook's dtype.

The reference is a hand computation from every rank's local gradient (taken by a plain DDP
under ``no_sync`` from the same weights and batch): each rank's share rounded to the wire's
dtype, then summed in fp32 in rank order. A sum in the low precision would be off by up to
one low-precision rounding of the sum; the tests check that such a sum is outside their
tolerance on the data used, so they would see it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel.distributed import _MixedPrecision

import gradsync.hooks as gradsync_hooks
from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import global_batch, loss_fn, make_model, rank_world, shard
from zero_support import identical_across_ranks, max_relative_difference

HOOKS = {
    "torch_fp16": (default_hooks.fp16_compress_hook, torch.float16),
    "torch_bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
    "gradsync_fp16": (gradsync_hooks.fp16_compress_hook, torch.float16),
    "gradsync_bf16": (gradsync_hooks.bf16_compress_hook, torch.bfloat16),
}


def _local_grads(model: torch.nn.Module, mixed: _MixedPrecision | None, x: torch.Tensor, y: torch.Tensor) -> list:
    probe = DDP(copy.deepcopy(model), mixed_precision=mixed)
    with probe.no_sync():
        loss_fn(probe(x), y).backward()
    return [p.grad.detach().clone() for p in probe.module.parameters()]


def _hand_average(grads: list[torch.Tensor], wire: torch.dtype, world: int) -> tuple[list, list]:
    """Per parameter: the fp32 sum of each rank's rounded share, and the same summed in ``wire``."""
    fp32_sums, wire_sums = [], []
    for local in grads:
        everyone = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(everyone, local)
        shares = [(g / world).to(wire) for g in everyone]
        total, low = shares[0].float(), shares[0]
        for share in shares[1:]:
            total, low = total + share.float(), low + share
        fp32_sums.append(total)
        wire_sums.append(low.float())
    return fp32_sums, wire_sums


def _worst(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(((a - e).abs().max() / e.abs().max().clamp_min(1e-12)).item() for a, e in zip(actual, expected))


def _one_step(stage: int, mode: str, hook_first: bool) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = make_model("mlp")
    mixed = _MixedPrecision(param_dtype=torch.bfloat16) if mode == "mixed_bf16" else None
    hook, wire = HOOKS.get(mode, (None, torch.bfloat16))
    x, y = global_batch("mlp", world, 0)
    x, y = shard(x, rank, world), shard(y, rank, world)
    fp32_sums, wire_sums = _hand_average(_local_grads(model, mixed, x, y), wire, world)
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, bucket_cap_mb=0.001, mixed_precision=mixed)
    if hook is not None and hook_first:
        ddp.register_comm_hook(None, hook)
    optimizer = ShardedOptimizer(ddp, torch.optim.SGD, stage=stage, lr=1.0)
    if hook is not None and not hook_first:
        ddp.register_comm_hook(None, hook)
    loss_fn(ddp(x), y).backward()
    if stage == 1:  # .grad: the fp32 sum, rounded once to the wire's dtype by the all-gather
        expected = [s.to(wire).float() for s in fp32_sums]
        grads = [p.grad.clone() for p in model.parameters()]
        # (At two ranks that equals the low-precision sum: a sum of two such values is exact in fp32.)
        return {"error": _worst(grads, expected), "low_sum_error": None}
    optimizer.step()
    stepped = [b.add(s, alpha=-1.0) for b, s in zip(before, fp32_sums)]
    low = [b.add(s, alpha=-1.0) for b, s in zip(before, wire_sums)]
    moved = [b - s for b, s in zip(before, stepped)]
    return {
        "error": _worst([b - p for b, p in zip(before, model.parameters())], moved),
        "low_sum_error": _worst([b - q for b, q in zip(before, low)], moved),
        "identical": identical_across_ranks(model),
    }


@pytest.mark.parametrize(
    "stage,mode,hook_first",
    [
        (2, "mixed_bf16", False),
        (1, "mixed_bf16", False),
        (2, "torch_fp16", True),
        (2, "gradsync_bf16", False),
        (1, "torch_bf16", False),
        (1, "gradsync_fp16", True),
    ],
)
def test_low_precision_on_the_wire_adds_up_in_fp32(stage: int, mode: str, hook_first: bool) -> None:
    for rank, result in enumerate(run_distributed(_one_step, 2, stage, mode, hook_first)):
        assert result["error"] <= 1e-5, f"rank {rank}: {result['error']:.3g} from the fp32 sum of rounded shares"
        if result["low_sum_error"] is not None:
            assert result["low_sum_error"] > 1e-5, "the data cannot tell an fp32 sum from a low-precision one"
        assert result.get("identical", True), f"replicas differ on rank {rank}"


def _training(stage: int) -> dict:
    """Several AdamW steps in bf16 against DDP with the same mixed_precision and torch's AdamW."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = make_model("mlp")
    reference_model = copy.deepcopy(model)
    mixed = _MixedPrecision(param_dtype=torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=0.001, mixed_precision=mixed)
    reference = DDP(reference_model, bucket_cap_mb=0.001, mixed_precision=mixed)
    sharded = ShardedOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=1e-2)
    plain = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
        for step in range(4):
            x, y = global_batch("mlp", world, step)
            optimizer.zero_grad()
            loss_fn(wrapper(shard(x, rank, world)), shard(y, rank, world)).backward()
            optimizer.step()
    return {
        "difference": max_relative_difference(model, reference_model),
        "identical": identical_across_ranks(model),
        "fp32_master": all(p.dtype == torch.float32 for p in model.parameters()),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_mixed_precision_trains_like_ddp(stage: int) -> None:
    for result in run_distributed(_training, 2, stage):
        assert result["identical"] and result["fp32_master"], result
        # bf16 gradients: the sums differ by a bf16 rounding; Adam normalises the steps.
        assert result["difference"] <= 2e-2, result


def _refused() -> list[str]:
    torch.manual_seed(0)
    messages = []
    ddp = DDP(make_model("mlp"))
    ShardedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    with pytest.raises(ValueError) as error:
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    messages.append(str(error.value))
    before = DDP(make_model("mlp"))
    before.register_comm_hook(gradsync_hooks.PowerSGDState(None), gradsync_hooks.powersgd_hook)
    with pytest.raises(ValueError) as error:
        ShardedOptimizer(before, torch.optim.SGD, lr=0.1)
    messages.append(str(error.value))
    return messages


def test_hooks_that_need_the_whole_bucket_are_refused_by_name() -> None:
    after, before = run_distributed(_refused, 2)[0]
    assert "Comm hook powerSGD_hook cannot be applied to a sharded optimizer's reduce-scatter (rank 0)" in after
    assert "Comm hook powersgd_hook cannot be applied" in before and "fp16_compress_hook" in before
