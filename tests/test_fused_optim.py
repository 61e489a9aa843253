"""``_register_fused_optim``: the optimizer steps each bucket as its reduction completes.

The reference is independent of gradsync: single-process training on the concatenated batch with
an ordinary optimizer stepped after backward (and, for one case, torch's DDP).
"""

from __future__ import annotations

import copy

import pytest
import torch

from gradsync import DistributedDataParallel as DDP
from gradsync.hooks import allreduce_hook

from harness import run_distributed
from models import (
    assert_params_close,
    assert_replicas_identical,
    global_batch,
    loss_fn,
    make_model,
    rank_world,
    reference_step,
    shard,
)


def _sgd_momentum_over_rebuilt_buckets(name: str) -> int:
    rank, world = rank_world()
    model = make_model(name)
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets; rebuilt after the first step
    ddp._register_fused_optim(torch.optim.SGD, 0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(8):
        x, y = global_batch(name, world, step)
        model.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()  # steps inside
        ref_opt.zero_grad()
        reference_step(reference, x, y, world)
        ref_opt.step()
        assert_replicas_identical(model, step)
    assert_params_close(model, reference)
    return len(ddp.engine.buckets.storages)


@pytest.mark.parametrize("name", ["mlp", "cnn_bn"])
def test_sgd_with_momentum_stepped_per_bucket_matches_single_process(name: str) -> None:
    buckets = run_distributed(_sgd_momentum_over_rebuilt_buckets, 2, name)
    assert min(buckets) > 1  # the steps really were split over buckets


def _adam_subset_hook_and_accumulation() -> None:
    rank, world = rank_world()
    model = make_model("mlp")
    reference = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, allreduce_hook)  # torch's version refuses a hook; this one composes
    params = list(model.parameters())
    fused, rest = params[: len(params) // 2], params[len(params) // 2 :]
    ddp._register_fused_optim(torch.optim.Adam, lr=1e-2, optim_params=fused)
    own = torch.optim.Adam(rest, lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(4):
        model.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):  # accumulate: the no_sync backward steps nothing
            x, y = global_batch("mlp", world, 10 * step + micro)
            if micro == 0:
                with ddp.no_sync():
                    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            else:
                loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            reference_step(reference, x, y, world)
        own.step()
        ref_opt.step()
    assert_params_close(model, reference)


def test_adam_on_a_subset_with_a_comm_hook_and_accumulation_matches_single_process() -> None:
    run_distributed(_adam_subset_hook_and_accumulation, 2)


def _misuse() -> list[str]:
    ddp = DDP(make_model("mlp"))
    found = []
    for call in (
        lambda: ddp._register_fused_optim(object, 0.1),
        lambda: ddp._register_fused_optim(torch.optim.SGD, 0.1, optim_params=[torch.nn.Parameter(torch.ones(2))]),
        lambda: ddp._register_fused_optim(torch.optim.SGD, -1.0),
    ):
        try:
            call()
            found.append("no error")
        except (TypeError, ValueError, RuntimeError) as error:
            found.append(f"{type(error).__name__}: {error}")
    ddp._register_fused_optim(torch.optim.SGD, 0.1)
    try:
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
        found.append("no error")
    except RuntimeError as error:
        found.append(f"RuntimeError: {error}")
    return found


def test_misuse_of_register_fused_optim_is_refused() -> None:
    found = run_distributed(_misuse, 1)[0]
    assert found[0].startswith("TypeError") and "torch.optim.Optimizer class" in found[0]
    assert found[1].startswith("ValueError") and "not parameters this DistributedDataParallel reduces" in found[1]
    assert found[2].startswith("ValueError") and "Invalid learning rate" in found[2]  # torch's own check, up front
    assert found[3].startswith("RuntimeError") and "should only be called once" in found[3]
