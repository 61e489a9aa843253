"""no_sync: local accumulation, then one synced backward reduces the accumulated sum."""

from __future__ import annotations

import copy

import pytest

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import assert_grads_close, global_batch, grads_of, loss_fn, make_model, rank_world, reference_step, shard


def _accumulate(micro_batches: int, as_view: bool, cap: float) -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=cap)
    for step in range(2):  # the second round runs on rebuilt buckets and reused .grad
        model.zero_grad()
        reference.zero_grad()
        for micro in range(micro_batches):
            x, y = global_batch("mlp", world, 10 * step + micro)
            if micro < micro_batches - 1:
                with ddp.no_sync():
                    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
                    assert ddp.require_backward_grad_sync is False
            else:
                loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            reference_step(reference, x, y, world)
        assert_grads_close(grads_of(model), grads_of(reference))


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("cap", [0.001, 0.0001])  # shared buckets; every weight alone, reduced in its .grad
def test_no_sync_accumulation_equals_synced_result(as_view: bool, cap: float) -> None:
    run_distributed(_accumulate, 2, 3, as_view, cap)


def _local_inside_no_sync() -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    x, y = global_batch("mlp", world, 0)
    with ddp.no_sync():
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    # gradients are this rank's alone: equal to a local backward on the local shard
    loss_fn(reference(shard(x, rank, world)), shard(y, rank, world)).backward()
    assert_grads_close(grads_of(model), grads_of(reference), atol=0, rtol=0)


def test_no_sync_keeps_gradients_local() -> None:
    run_distributed(_local_inside_no_sync, 2)


def _exception_inside_no_sync() -> None:
    ddp = DDP(make_model("mlp"))
    with pytest.raises(KeyError):
        with ddp.no_sync():
            raise KeyError("user code failed")
    assert ddp.require_backward_grad_sync is True
    # training continues normally: a synced step after the failure still agrees
    rank, world = rank_world()
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()


def test_exception_inside_no_sync_restores_sync() -> None:
    run_distributed(_exception_inside_no_sync, 2)
