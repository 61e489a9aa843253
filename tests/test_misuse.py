"""Misuse gradsync detects (the table in docs/misuse.md), or handles correctly where torch is silent."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import (
    MLP,
    assert_grads_close,
    global_batch,
    grads_of,
    loss_fn,
    make_model,
    rank_world,
    shard,
)


def _parameter_added_after_wrapping(kind: str) -> str:
    rank, world = rank_world()
    model = MLP()
    ddp = DDP(model)
    x, _ = global_batch("mlp", world, 0)
    ddp(shard(x, rank, world)).sum().backward()
    if kind == "parameter":
        model.head.register_parameter("scale", nn.Parameter(torch.ones(4)))
    elif kind == "submodule":
        model.extra = nn.Linear(4, 4)
    else:  # replacing an existing parameter leaves the wrapper hooking the old one
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    with pytest.raises(RuntimeError) as error:
        ddp(shard(x, rank, world))
    return str(error.value)


@pytest.mark.parametrize(
    "kind, name", [("parameter", "head.scale"), ("submodule", "extra"), ("replaced", "head.weight")]
)
def test_parameters_added_after_wrapping_are_named(kind: str, name: str) -> None:
    for rank, message in enumerate(run_distributed(_parameter_added_after_wrapping, 2, kind)):
        assert f"['{name}']" in message and f"rank {rank}" in message and "wrap it again" in message


def _two_forwards_one_backward(find_unused: bool) -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=find_unused)
    x, y = global_batch("mlp", world, 0)
    x2, y2 = global_batch("mlp", world, 1)
    loss = loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world))
    loss = loss + loss_fn(ddp(shard(x2, rank, world)), shard(y2, rank, world))
    loss.backward()
    ref = [
        loss_fn(reference(shard(a, r, world)), shard(b, r, world)) for r in range(world) for a, b in ((x, y), (x2, y2))
    ]
    (sum(ref) / world).backward()
    assert_grads_close(grads_of(model), grads_of(reference))


@pytest.mark.parametrize("find_unused", [False, True])
def test_two_forwards_before_one_backward_are_synchronised(find_unused: bool) -> None:
    run_distributed(_two_forwards_one_backward, 2, find_unused)


def _backward_through_previous_iteration() -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    x, y = global_batch("mlp", world, 0)
    old_loss = loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world))
    with torch.no_grad():
        ddp(shard(x, rank, world))  # an evaluation forward in between
    old_loss.backward()  # the graph of the previous synced forward
    (sum(loss_fn(reference(shard(x, r, world)), shard(y, r, world)) for r in range(world)) / world).backward()
    assert_grads_close(grads_of(model), grads_of(reference))


def test_backward_through_an_earlier_graph_is_synchronised() -> None:
    run_distributed(_backward_through_previous_iteration, 2)


def _no_sync_on_one_rank() -> str:
    rank, world = rank_world()
    ddp = DDP(MLP())
    ddp.enable_desync_detection(timeout_s=5)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    if rank == 1:  # rank 1 skips synchronising one step that rank 0 synchronises
        with ddp.no_sync():
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        return ""
    with pytest.raises(RuntimeError) as error:
        for _ in range(2):
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(error.value)


def test_no_sync_on_some_ranks_only_is_reported_in_desync_mode() -> None:
    message = run_distributed(_no_sync_on_one_rank, 2, isolated=True)[0]
    assert "gradsync desync: rank 0 is about to issue all-reduce of bucket 0" in message, message
    assert "for synced forward #3" in message and "Ranks 1 failed to pass monitoredBarrier" in message


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, with_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h + self.extra(h) if with_extra else h)


def _different_batch_structure() -> str:
    """Rank 1's batch takes another branch: it leaves parameters without gradient."""
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(Branches())
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world), with_extra=True), shard(y, rank, world)).backward()
    try:
        loss_fn(ddp(shard(x, rank, world), with_extra=rank == 0), shard(y, rank, world)).backward()
    except RuntimeError as error:
        return str(error)
    return ""


def test_batch_taking_different_branches_names_the_parameters() -> None:
    # Rank 0 completes the step (its collectives all match); rank 1 names what it skipped.
    messages = run_distributed(_different_batch_structure, 2)
    assert messages[0] == ""
    assert "['extra.weight', 'extra.bias'] received no gradient on rank 1 in iteration 1" in messages[1]


def _backward_raised_half_way() -> str:
    rank, world = rank_world()
    model = make_model("mlp")
    ddp = DDP(model, bucket_cap_mb=0.001)

    def user_hook_fails(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("user hook failed")

    handle = model.layers[0][0].weight.register_hook(user_hook_fails)
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(ValueError, match="user hook failed"):
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    handle.remove()
    with pytest.raises(RuntimeError) as error:
        ddp(shard(x, rank, world))
    return str(error.value)


def test_training_on_after_a_failed_backward_is_refused() -> None:
    for rank, message in enumerate(run_distributed(_backward_raised_half_way, 2, isolated=True)):
        assert f"started reducing gradients on rank {rank} but never finished" in message


def _shared_grad_tensor() -> str:
    rank, world = rank_world()
    model = MLP()  # hidden weights are 16 x 16: 1 KiB, above a 512-byte cap, so each is reduced in place
    ddp = DDP(model, bucket_cap_mb=512 / 2**20)
    shared = torch.zeros(16, 16)
    model.layers[0][0].weight.grad = shared
    model.layers[2][0].weight.grad = shared  # one tensor as the .grad of two parameters
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(RuntimeError) as caught:
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(caught.value)


def test_one_grad_tensor_shared_by_two_parameters_is_refused() -> None:
    message = run_distributed(_shared_grad_tensor, 2)[0]
    assert "share one .grad tensor" in message and "layers.0.0.weight" in message and "layers.2.0.weight" in message
    assert "rank 0" in message
