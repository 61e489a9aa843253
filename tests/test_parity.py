"""Gradients and weights equal single-process training, and torch's own DDP."""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import (
    MODELS,
    all_gather_flat,
    assert_grads_close,
    assert_params_close,
    assert_replicas_identical,
    global_batch,
    grads_of,
    loss_fn,
    make_model,
    rank_world,
    reference_step,
    shard,
)

CAPS = {"tiny": 0.0001, "default": None, "huge": 1000.0}


def _one_backward_sweep() -> int:
    rank, world = rank_world()
    checked = 0
    for name in MODELS:
        for cap in CAPS.values():
            for as_view in (False, True):
                find_unused = name == "unused_branch"
                model = make_model(name)
                reference = copy.deepcopy(model)
                ddp = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=as_view, find_unused_parameters=find_unused)
                for step in range(3):  # the second and third steps run on rebuilt buckets
                    x, y = global_batch(name, world, step)
                    # The third step keeps the (zeroed) .grad tensors: bucket views stay in place.
                    model.zero_grad(set_to_none=step < 2)
                    reference.zero_grad(set_to_none=step < 2)
                    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
                    reference_step(reference, x, y, world)
                    assert_grads_close(grads_of(model), grads_of(reference))
                    checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_one_backward_matches_single_process(world_size: int) -> None:
    counts = run_distributed(_one_backward_sweep, world_size, timeout_s=240)
    assert counts == [len(MODELS) * len(CAPS) * 2 * 3] * world_size


def _train_20_steps(name: str, as_view: bool) -> None:
    rank, world = rank_world()
    model = make_model(name)
    reference = copy.deepcopy(model)
    ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        x, y = global_batch(name, world, step)
        opt.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
        ref_opt.zero_grad()
        reference_step(reference, x, y, world)
        ref_opt.step()
        assert_replicas_identical(model, step)
    assert_params_close(model, reference)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "cnn_bn"])
@pytest.mark.parametrize("as_view", [False, True])
def test_twenty_sgd_steps_match_single_process(world_size: int, name: str, as_view: bool) -> None:
    run_distributed(_train_20_steps, world_size, name, as_view)


def _compare_with_torch_ddp(name: str) -> None:
    rank, world = rank_world()
    ours_model = make_model(name)
    torch_model = copy.deepcopy(ours_model)
    ours = DDP(ours_model, find_unused_parameters=name == "unused_branch")
    theirs = torch.nn.parallel.DistributedDataParallel(torch_model, find_unused_parameters=name == "unused_branch")
    for step in range(3):
        x, y = global_batch(name, world, step)
        for ddp in (ours, theirs):
            ddp.zero_grad()
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        assert_grads_close(grads_of(ours_model), grads_of(torch_model), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "cnn_bn", "unused_branch", "mixed_fp32_fp64", "sparse_embedding", "wide"])
def test_gradients_match_torch_ddp(name: str) -> None:
    run_distributed(_compare_with_torch_ddp, 2, name)


class _Switch(torch.nn.Module):
    """``up`` (131K weights) is used unless told otherwise; ``side`` only then."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 8192)
        self.down = torch.nn.Linear(8192, 4)
        self.side = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_up: bool = True) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) if use_up else self.side(x)


def _lone_large_gradient_in_place() -> None:
    """A parameter above the bucket cap is reduced in its own .grad (bucket_set.py explains).

    Checked from the outside: .grad stays the tensor it was (torch's contract without bucket
    views: zero_grad(set_to_none=False) keeps it, autograd accumulates into it) and holds the
    average of the ranks' gradients. In the last step the last rank does not use ``up``
    (find_unused): it takes the copying path while the others reduce in place, and all must
    still agree with the hand-computed average. The bucket's flat buffer holds memory only on the
    rank that took the copying path, from then on.
    """
    rank, world = rank_world()
    torch.manual_seed(0)
    model = _Switch()
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.25, find_unused_parameters=True)  # up.weight is 512 KiB: alone
    for step in range(4):
        x, y = global_batch("mlp", world, step)
        uses_up = [step < 3 or r != world - 1 for r in range(world)]
        model.zero_grad(set_to_none=step == 0)
        reference.zero_grad(set_to_none=step == 0)
        kept = model.up.weight.grad
        loss_fn(ddp(shard(x, rank, world), use_up=uses_up[rank]), shard(y, rank, world)).backward()
        shard_losses = [
            loss_fn(reference(shard(x, r, world), use_up=uses_up[r]), shard(y, r, world)) for r in range(world)
        ]
        (sum(shard_losses) / world).backward()
        assert_grads_close(grads_of(model), grads_of(reference))
        if step > 0:
            assert model.up.weight.grad is kept, "the reduced .grad must be the tensor it was"
        # its bucket's flat buffer gets memory only when the copying path first needs it (storage.py)
        lone = next(s for s in ddp.engine.buckets.storages if len(s.params) == 1 and s.params[0] is model.up.weight)
        copied = step == 3 and rank == world - 1
        assert lone.allocated == copied, f"rank {rank} step {step}: allocated {lone.allocated}"
    gathered = all_gather_flat([model.up.weight.grad])
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@pytest.mark.parametrize("world_size", [2, 3])
def test_lone_large_gradient_is_reduced_in_its_own_grad(world_size: int) -> None:
    run_distributed(_lone_large_gradient_in_place, world_size)


def _accumulate_across_rebuild() -> int:
    """No zero_grad between steps: .grad carries over the bucket rebuild (in every bucket kind)."""
    rank, world = rank_world()
    checked = 0
    for cap in (0.0001, 0.25, None):  # everything alone, the big weight alone, default caps
        for as_view in (False, True):
            model = make_model("wide")
            reference = copy.deepcopy(model)
            ddp = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=as_view)
            for step in range(3):  # the rebuild happens before step 1's forward, with .grad set
                x, y = global_batch("wide", world, step)
                loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
                reference_step(reference, x, y, world)
                assert_grads_close(grads_of(model), grads_of(reference))
                checked += 1
    return checked


def _other_hooks_see_the_local_gradient() -> None:
    """Someone else's post-accumulate-grad hook reads the local gradient, as with torch's DDP."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = _Switch()
    local = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.25, find_unused_parameters=True)
    seen: list[torch.Tensor] = []
    model.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        model.zero_grad()
        local.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        loss_fn(local(shard(x, rank, world)), shard(y, rank, world)).backward()
        assert torch.equal(seen[-1], local.up.weight.grad), "the hook must see this rank's own gradient"


def test_other_post_accumulate_hooks_see_the_local_gradient() -> None:
    run_distributed(_other_hooks_see_the_local_gradient, 2)


def test_gradients_accumulate_across_the_bucket_rebuild() -> None:
    assert run_distributed(_accumulate_across_rebuild, 2) == [18, 18]
