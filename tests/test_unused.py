"""Parameters without a gradient: found, reduced as torch does, or named in an error."""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import UnusedBranch, assert_grads_close, global_batch, grads_of, loss_fn, rank_world, shard


def _error_names_unused_parameters() -> str:
    rank, world = rank_world()
    torch.manual_seed(0)
    ddp = DDP(UnusedBranch())
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(RuntimeError) as error:
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(error.value)


def test_unused_parameters_without_flag_raise_at_the_offending_backward_on_every_rank() -> None:
    for rank, message in enumerate(run_distributed(_error_names_unused_parameters, 2)):
        assert "['unused.weight', 'unused.bias', 'sometimes.weight', 'sometimes.bias']" in message
        assert f"on rank {rank} in iteration 0" in message
        assert "find_unused_parameters=True" in message


def _find_unused_semantics(as_view: bool) -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = UnusedBranch()
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    for step in range(3):
        x, y = global_batch("mlp", world, step)
        model.zero_grad()
        reference.zero_grad()
        # 'sometimes' is used on the last rank only; 'unused' on no rank
        use = rank == world - 1
        loss_fn(ddp(shard(x, rank, world), use_sometimes=use), shard(y, rank, world)).backward()
        losses = [
            loss_fn(reference(shard(x, r, world), use_sometimes=r == world - 1), shard(y, r, world))
            for r in range(world)
        ]
        (sum(losses) / world).backward()
        grads = grads_of(model)
        assert grads["unused.weight"] is None and grads["unused.bias"] is None
        assert_grads_close(grads, grads_of(reference))


@pytest.mark.parametrize("as_view", [False, True])
def test_find_unused_parameters_matches_reference(as_view: bool) -> None:
    run_distributed(_find_unused_semantics, 2, as_view)


def _globally_unused_grad_untouched(as_view: bool) -> None:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = UnusedBranch()
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world), use_sometimes=True), shard(y, rank, world)).backward()
    # the user puts a value in .grad of a parameter no rank will use next step
    model.sometimes.weight.grad.fill_(1.0 / 3.0)
    before = model.sometimes.weight.grad.clone()
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    assert torch.equal(model.sometimes.weight.grad, before)


@pytest.mark.parametrize("as_view", [False, True])
def test_parameter_unused_on_every_rank_keeps_its_grad(as_view: bool) -> None:
    run_distributed(_globally_unused_grad_untouched, 3, as_view)


def _output_not_in_loss() -> None:
    """A parameter reachable from the outputs whose output is left out of the loss."""
    rank, world = rank_world()
    torch.manual_seed(0)

    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(16, 16)
            self.left = torch.nn.Linear(16, 4)
            self.right = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(x)
            return self.left(h), self.right(h)

    model = TwoHeads()
    reference = copy.deepcopy(model)
    ddp = DDP(model, find_unused_parameters=True)
    x, y = global_batch("mlp", world, 0)
    left, _ = ddp(shard(x, rank, world))
    loss_fn(left, shard(y, rank, world)).backward()
    losses = [loss_fn(reference(shard(x, r, world))[0], shard(y, r, world)) for r in range(world)]
    (sum(losses) / world).backward()
    assert_grads_close(grads_of(model), grads_of(reference))


def test_output_left_out_of_the_loss_is_handled_with_find_unused() -> None:
    run_distributed(_output_not_in_loss, 2)
