"""Reentrant checkpointing, static_graph, and backwards torch's DDP leaves unsynchronised."""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import CheckpointedTwice, assert_grads_close, global_batch, grads_of, loss_fn, rank_world, shard


def _train_checkpointed(static_graph: bool, use_reentrant: bool, as_view: bool) -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = CheckpointedTwice(use_reentrant)
    reference = copy.deepcopy(model)
    ddp = DDP(model, static_graph=static_graph, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        x, y = global_batch("mlp", world, step)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        (sum(loss_fn(reference(shard(x, r, world)), shard(y, r, world)) for r in range(world)) / world).backward()
        assert_grads_close(grads_of(model), grads_of(reference))
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("as_view", [False, True])
def test_reentrant_checkpoint_twice_works_with_static_graph(as_view: bool) -> None:
    run_distributed(_train_checkpointed, 2, True, True, as_view)


def test_non_reentrant_checkpoint_twice_works_without_static_graph() -> None:
    run_distributed(_train_checkpointed, 2, False, False, False)


def _reentrant_twice_without_static_graph() -> str:
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(CheckpointedTwice(use_reentrant=True))
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(RuntimeError) as error:
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(error.value)


def test_reentrant_checkpoint_twice_without_static_graph_raises_on_every_rank() -> None:
    for rank, message in enumerate(run_distributed(_reentrant_twice_without_static_graph, 2)):
        assert "'layer.weight'" in message and f"rank {rank}" in message
        assert "static_graph=True" in message and "use_reentrant=False" in message


def _static_graph_change_is_loud() -> str:
    rank, world = rank_world()
    torch.manual_seed(0)
    from models import UnusedBranch

    ddp = DDP(UnusedBranch(), static_graph=True)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    with pytest.raises(RuntimeError) as error:
        loss_fn(ddp(shard(x, rank, world), use_sometimes=True), shard(y, rank, world)).backward()
    return str(error.value)


def test_static_graph_that_changes_raises() -> None:
    for message in run_distributed(_static_graph_change_is_loud, 2):
        assert message.startswith("Expected to have finished reduction in the prior iteration")
        assert "static_graph set to True" in message and "'sometimes.weight'" in message


def _second_backward_on_retained_graph(as_view: bool) -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    from models import MLP

    model = MLP()
    reference = copy.deepcopy(model)
    ddp = DDP(model, gradient_as_bucket_view=as_view)
    x, y = global_batch("mlp", world, 0)
    loss = loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world))
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    ref_losses = [loss_fn(reference(shard(x, r, world)), shard(y, r, world)) for r in range(world)]
    ref_loss = sum(ref_losses) / world
    ref_loss.backward(retain_graph=True)
    (2 * ref_loss).backward()
    assert_grads_close(grads_of(model), grads_of(reference))


@pytest.mark.parametrize("as_view", [False, True])
def test_second_backward_on_retained_graph_is_synchronised(as_view: bool) -> None:
    run_distributed(_second_backward_on_retained_graph, 2, as_view)
