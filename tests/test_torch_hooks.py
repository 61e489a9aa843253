"""torch's own comm hooks run unchanged on gradsync and give torch DDP's gradients."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)

from gradsync import DistributedDataParallel as DDP
from test_collectives import OutOfOrder

from harness import run_distributed
from models import all_gather_flat, global_batch, grads_of, loss_fn, make_model, rank_world, shard


def _hook_and_state(name: str) -> tuple[Callable, Any]:
    """A fresh (hook, state) pair; stateful hooks need one state per DDP instance."""
    if name == "allreduce":
        return default_hooks.allreduce_hook, None
    if name == "fp16_compress":
        return default_hooks.fp16_compress_hook, None
    if name == "fp16_wrapper_allreduce":
        return default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), None
    if name == "powerSGD":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3, min_compression_rate=1.5
        )
        return powerSGD_hook.powerSGD_hook, state
    if name == "fp16_wrapper_powerSGD":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        return default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook), state
    if name == "noop":
        return debugging_hooks.noop_hook, None
    raise KeyError(name)


_SUBGROUPS: dict[int, Any] = {}


def _local_sgd_state() -> Any:
    # one subgroup per rank pair, created once per worker (new_subgroups is collective)
    world = dist.get_world_size()
    if world not in _SUBGROUPS:
        _SUBGROUPS[world], _ = dist.new_subgroups(group_size=1)
    return post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=_SUBGROUPS[world], start_localSGD_iter=3)


def _same_as_torch(name: str, model_name: str, as_view: bool, find_unused: bool, micro: int) -> None:
    rank, world = rank_world()
    ours_model = make_model(model_name)
    torch_model = copy.deepcopy(ours_model)
    kwargs = {"gradient_as_bucket_view": as_view, "find_unused_parameters": find_unused}
    ours = DDP(ours_model, **kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(torch_model, **kwargs)
    for ddp in (ours, theirs):
        if name == "post_localSGD":
            ddp.register_comm_hook(_local_sgd_state(), post_localSGD_hook.post_localSGD_hook)
        else:
            hook, state = _hook_and_state(name)
            ddp.register_comm_hook(state, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours_model, torch_model)]
    for step in range(6):
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            for k in range(micro):
                x, y = global_batch(model_name, world, 10 * step + k)
                if k < micro - 1:
                    with ddp.no_sync():
                        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
                else:
                    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        ours_grads, torch_grads = grads_of(ours_model), grads_of(torch_model)
        for pname in ours_grads:
            a, b = ours_grads[pname], torch_grads[pname]
            assert (a is None) == (b is None), pname
            if a is not None:
                assert torch.equal(a, b), f"step {step} {pname}: max diff {(a - b).abs().max().item()}"
        for opt in opts:
            opt.step()


HOOKS = ["allreduce", "fp16_compress", "fp16_wrapper_allreduce", "powerSGD", "fp16_wrapper_powerSGD", "noop"]


@pytest.mark.parametrize("name", HOOKS + ["post_localSGD"])
def test_torch_hook_matches_torch_ddp_bitwise(name: str) -> None:
    run_distributed(_same_as_torch, 2, name, "mlp", False, False, 1)


@pytest.mark.parametrize("name", ["allreduce", "fp16_compress", "powerSGD"])
def test_torch_hook_with_bucket_view_and_no_sync(name: str) -> None:
    run_distributed(_same_as_torch, 2, name, "mlp", True, False, 3)


@pytest.mark.parametrize("name", ["allreduce", "fp16_compress"])
def test_torch_hook_with_find_unused_parameters(name: str) -> None:
    run_distributed(_same_as_torch, 2, name, "unused_branch", False, True, 1)


def _bf16(wrapper: bool) -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    local = copy.deepcopy(model)
    ddp = DDP(model)
    if wrapper:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook))
    else:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    # hand reference: every rank's local gradient, cast to bf16, divided, summed in bf16
    per_rank = []
    for r in range(world):
        local.zero_grad()
        loss_fn(local(shard(x, r, world)), shard(y, r, world)).backward()
        per_rank.append({n: p.grad.clone() for n, p in local.named_parameters()})
    for name, p in model.named_parameters():
        if wrapper:  # allreduce_hook divides after the cast, inside the bf16 buffer
            parts = [g[name].to(torch.bfloat16) / world for g in per_rank]
        else:
            parts = [g[name].to(torch.bfloat16).div_(world) for g in per_rank]
        expected = parts[0]
        for part in parts[1:]:
            expected = expected + part
        assert torch.allclose(p.grad, expected.float(), rtol=0, atol=0), name
    replicas = all_gather_flat([p.grad for p in model.parameters()])
    assert all(torch.equal(replicas[0], r) for r in replicas)


@pytest.mark.parametrize("wrapper", [False, True])
def test_bf16_hooks_work_on_cpu_against_hand_reference(wrapper: bool) -> None:
    run_distributed(_bf16, 2, wrapper)


def _bucket_index_follows_launch_order() -> list[list[int]]:
    torch.manual_seed(0)
    seen: list[list[int]] = []

    def spy(state, bucket):
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append((bucket.index(), bucket.is_last(), bucket.buffer().numel()))
        grads = bucket.gradients()
        assert all(g.data_ptr() >= bucket.buffer().data_ptr() for g in grads)
        assert sum(g.numel() for g in grads) == bucket.buffer().numel()
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DDP(OutOfOrder(), bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, spy)
    x = torch.randn(2, 16)
    for _ in range(3):
        ddp(x).sum().backward()
    return seen


def test_bucket_index_follows_launch_order_and_changes_at_rebuild() -> None:
    seen = run_distributed(_bucket_index_follows_launch_order, 2)[0]
    for iteration in seen:
        assert [i for i, _, _ in iteration] == [0, 1]
        assert [last for _, last, _ in iteration] == [False, True]
    # iteration 1 launches a's bucket (128 elements) first; after the rebuild b's (32) comes first
    assert [n for _, _, n in seen[0]] == [128, 32]
    assert [n for _, _, n in seen[1]] == [32, 128] == [n for _, _, n in seen[2]]


def _wrong_shape_hook() -> str:
    rank, world = rank_world()

    def truncating_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer()[:3].clone())
        return fut

    ddp = DDP(make_model("mlp"))
    ddp.register_comm_hook(None, truncating_hook)
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(RuntimeError) as error:
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(error.value)


def test_hook_result_with_wrong_shape_is_named() -> None:
    for message in run_distributed(_wrong_shape_hook, 2):
        assert "truncating_hook" in message and "bucket 0" in message and "shape (3,)" in message
