"""Uneven inputs: ranks that run out of data shadow the others; nobody hangs.

Reference: one process simulates the run, averaging at each step the gradients of the
ranks that still have data (divided by the initial world size, or by the number of
ranks still active), and applying the same SGD step.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import all_gather_flat, global_batch, loss_fn, make_model, rank_world, shard

LR = 0.1


def _use_sometimes(name: str, rank: int, step: int) -> dict:
    return {"use_sometimes": (rank + step) % 2 == 0} if name == "unused_branch" else {}


def _simulate(model: torch.nn.Module, name: str, counts: list[int], divide_by_initial: bool, micro: int) -> None:
    world = len(counts)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(max(counts)):
        active = [r for r in range(world) if step < counts[r]]
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in active:
            for k in range(micro):
                model.zero_grad()
                x, y = global_batch(name, world, step * micro + k)
                loss_fn(model(shard(x, r, world), **_use_sometimes(name, r, step)), shard(y, r, world)).backward()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        total[n] += p.grad
        divisor = world if divide_by_initial else len(active)
        for n, p in model.named_parameters():
            p.grad = total[n] / divisor
        opt.step()


def _train_uneven(name: str, counts: list[int], divide_by_initial: bool, micro: int, hook: bool) -> None:
    rank, world = rank_world()
    model = make_model(name)
    reference = copy.deepcopy(model)
    # 734-byte buckets: every weight (>= 864 bytes) travels alone and, without a hook, is reduced
    # in its own .grad while a joined rank contributes zeros; the biases share buckets.
    ddp = DDP(model, find_unused_parameters=name == "unused_branch", bucket_cap_mb=0.0007)
    if hook:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(counts[rank]):
            opt.zero_grad()
            for k in range(micro):
                x, y = global_batch(name, world, step * micro + k)
                kwargs = _use_sometimes(name, rank, step)
                if k < micro - 1:
                    with ddp.no_sync():
                        loss_fn(ddp(shard(x, rank, world), **kwargs), shard(y, rank, world)).backward()
                else:
                    loss_fn(ddp(shard(x, rank, world), **kwargs), shard(y, rank, world)).backward()
            for p in model.parameters():  # parameters no rank used this step keep no gradient
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
    state = list(model.parameters()) + [b.float() for b in model.buffers() if b.is_floating_point()]
    replicas = all_gather_flat(state)
    assert all(torch.equal(replicas[0], r) for r in replicas), f"replicas differ after join, counts {counts}"
    _simulate(reference, name, counts, divide_by_initial, micro)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-4), f"{n} differs from the reference, counts {counts}"


def _count_patterns(world: int) -> list[list[int]]:
    """Each rank in turn runs out first, by 0, 1 or many iterations; one rank with no data."""
    patterns = [[3] * world]
    for short, skew in itertools.product(range(world), (1, 4)):
        patterns.append([3 + skew if r != short else 3 for r in range(world)])
    patterns.append([0] + [3] * (world - 1))
    return patterns


def _sweep(name: str, divide_by_initial: bool, micro: int, hook: bool) -> int:
    _, world = rank_world()
    patterns = _count_patterns(world)
    for counts in patterns:
        _train_uneven(name, counts, divide_by_initial, micro, hook)
    return len(patterns)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_uneven_inputs_match_reference(world_size: int, divide_by_initial: bool) -> None:
    run_distributed(_sweep, world_size, "mlp", divide_by_initial, 1, False, timeout_s=240)


def test_uneven_inputs_with_no_sync_accumulation() -> None:
    run_distributed(_sweep, 3, "mlp", True, 2, False, timeout_s=240)


def test_uneven_inputs_with_comm_hook() -> None:
    run_distributed(_sweep, 2, "mlp", True, 1, True, timeout_s=240)


def test_uneven_inputs_with_find_unused_parameters() -> None:
    run_distributed(_sweep, 3, "unused_branch", True, 1, False, timeout_s=240)


def test_uneven_inputs_with_buffers() -> None:
    run_distributed(_sweep, 2, "cnn_bn", False, 1, False, timeout_s=240)


def _divide_factor(divide_by_initial: bool) -> float:
    """Ranks run 1 and 3 iterations; each feeds x = rank + 1 into sum(w * x)."""
    rank, _ = rank_world()
    layer = torch.nn.Linear(1, 1, bias=False)
    ddp = DDP(layer)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for _ in range(1 if rank == 0 else 3):
            layer.zero_grad()
            ddp(torch.tensor([[rank + 1.0]])).sum().backward()
    return layer.weight.grad.item()


def test_divide_by_initial_world_size() -> None:
    # the last gradient on rank 1: only it is active, its local gradient is 2.0
    assert run_distributed(_divide_factor, 2, True)[1] == 1.0
    assert run_distributed(_divide_factor, 2, False)[1] == 2.0


def _throw_on_early_termination() -> str:
    rank, _ = rank_world()
    ddp = DDP(make_model("mlp"))
    with pytest.raises(RuntimeError) as error:
        with ddp.join(throw_on_early_termination=True):
            for _ in range(1 if rank == 0 else 3):
                ddp(torch.randn(2, 16)).sum().backward()
    return str(error.value)


def test_throw_on_early_termination() -> None:
    first, second = run_distributed(_throw_on_early_termination, 2)
    assert "Rank 0 exhausted all inputs" in first
    assert "exhausted inputs" in second


def _zero_redundancy_optimizer() -> None:
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, world = rank_world()
    model = make_model("mlp")
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
    with Join([ddp, opt]):
        for step in range(2 + 3 * rank):
            opt.zero_grad()
            x, y = global_batch("mlp", world, step)
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
    replicas = all_gather_flat(list(model.parameters()))
    assert all(torch.equal(replicas[0], r) for r in replicas)


def test_generic_join_with_zero_redundancy_optimizer() -> None:
    run_distributed(_zero_redundancy_optimizer, 2)


def _skew_warning() -> list[str]:
    rank, _ = rank_world()
    layer = torch.nn.Linear(2, 1)
    ddp = DDP(layer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ddp.join():
            for _ in range(0 if rank == 0 else 1002):
                ddp(torch.ones(1, 2)).sum().backward()
    dist.barrier()
    return [str(w.message) for w in caught]


def test_warns_when_skew_exceeds_threshold() -> None:
    joined_early, _ = run_distributed(_skew_warning, 2)
    assert any("uneven input skew of greater than 1000" in message for message in joined_early)


def _sync_batchnorm_under_join(throw: bool) -> str:
    from gradsync import SyncBatchNorm

    rank, _ = rank_world()
    model = SyncBatchNorm.convert_sync_batchnorm(make_model("cnn_bn"))
    ddp = DDP(model)
    try:
        with ddp.join(throw_on_early_termination=throw):
            for _ in range(1 if rank == 0 else 2):
                ddp(torch.randn(2, 3, 8, 8)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return ""


def test_sync_batchnorm_under_join_needs_throw_on_early_termination() -> None:
    for message in run_distributed(_sync_batchnorm_under_join, 2, False):
        assert "['bn1', 'bn2'] communicate inside forward" in message
        assert "throw_on_early_termination=True" in message
    first, second = run_distributed(_sync_batchnorm_under_join, 2, True)
    assert "Rank 0 exhausted all inputs" in first and "exhausted inputs" in second
