"""torch 2.13's less common constructor arguments: mixed_precision, skip_all_reduce_unused_params,
delay_all_reduce_named_params; and static_graph with a parameter no rank uses. Each is checked
against torch's DDP where torch runs on CPU, else against a hand computation."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import (
    MLP,
    UnusedBranch,
    all_gather_flat,
    global_batch,
    grads_of,
    loss_fn,
    rank_world,
    reference_step,
    shard,
)


def _static_graph_never_used() -> dict:
    rank, world = rank_world()
    grads = {}
    for name, wrapper in (("gradsync", DDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = UnusedBranch()
        ddp = wrapper(model, static_graph=True)
        for i in range(3):
            x, y = global_batch("mlp", world, i)
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        grads[name] = grads_of(model)
    return grads


def test_static_graph_leaves_a_never_used_parameter_without_grad_like_torch() -> None:
    """Otherwise Adam or weight decay would move a parameter that never got a gradient."""
    for grads in run_distributed(_static_graph_never_used, 2):
        ours, theirs = grads["gradsync"], grads["torch"]
        assert ours["unused.weight"] is None and theirs["unused.weight"] is None
        for name in ours:
            if theirs[name] is not None:
                assert torch.allclose(ours[name], theirs[name], atol=1e-6), name


# ---------------------------------------------------------------- mixed_precision
def _bf16_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, world: int, reduce: torch.dtype) -> dict:
    """By hand: each rank's gradient of a bf16 copy of the model, averaged in ``reduce``."""
    per_rank = []
    for r in range(world):
        low = copy.deepcopy(model).to(torch.bfloat16)
        loss_fn(low(shard(x, r, world).to(torch.bfloat16)).float(), shard(y, r, world)).backward()
        per_rank.append({n: p.grad for n, p in low.named_parameters()})
    average = {}
    for name in per_rank[0]:
        total = per_rank[0][name].to(reduce) / world
        for grads in per_rank[1:]:
            total = total + grads[name].to(reduce) / world
        average[name] = total.float()
    return average


def _mixed_precision(reduce_dtype: Any) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    before = copy.deepcopy(model)
    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    ddp = DDP(model, mixed_precision=config)
    x, y = global_batch("mlp", world, 0)
    out = ddp(shard(x, rank, world))
    loss_fn(out.float(), shard(y, rank, world)).backward()
    expected = _bf16_reference(before, x, y, world, reduce_dtype or torch.bfloat16)
    full = copy.deepcopy(before)
    reference_step(full, x, y, world)
    grads = grads_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    return {
        "out_dtype": out.dtype,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": {g.dtype for g in grads.values()},
        "max_diff": max((grads[n] - expected[n]).abs().max().item() for n in grads),
        "differs_from_fp32": max((grads[n] - g.grad).abs().max().item() for n, g in full.named_parameters()),
        "replicas": [t.tolist() for t in all_gather_flat(list(model.parameters()))],
        "bucket_dtypes": {str(s.flat.dtype) for s in ddp.engine.buckets.storages},
    }


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_mixed_precision_computes_low_reduces_in_reduce_dtype_keeps_fp32_weights(reduce_dtype: Any) -> None:
    for result in run_distributed(_mixed_precision, 2, reduce_dtype):
        assert result["out_dtype"] == torch.bfloat16  # forward ran in param_dtype
        assert result["param_dtypes"] == {torch.float32} and result["grad_dtypes"] == {torch.float32}
        assert result["bucket_dtypes"] == {str(reduce_dtype or torch.bfloat16)}
        assert result["max_diff"] <= 1e-6, "gradients differ from the hand-computed bf16 average"
        assert result["differs_from_fp32"] > 1e-4, "the gradients look like full-precision ones"
        assert result["replicas"][0] == result["replicas"][1]


def _torch_mixed_precision_on_cpu() -> str:
    try:
        ddp = TorchDDP(MLP(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
        ddp(torch.zeros(2, 16)).float().sum().backward()
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_torch_mixed_precision_does_not_run_on_cpu() -> None:
    """Why the mixed-precision test compares with a hand computation, not with torch's DDP."""
    for message in run_distributed(_torch_mixed_precision_on_cpu, 2):
        assert "doesn't support events" in message


# ---------------------------------------------------------------- skip_all_reduce_unused_params
def _count_all_reduces(run: Any) -> tuple[Any, int]:
    original, count = dist.all_reduce, [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        return run(), count[0]
    finally:
        dist.all_reduce = original


def _skip_unused(skip: bool) -> dict:
    rank, world = rank_world()
    results, counts = {}, {}
    for name, wrapper in (("gradsync", DDP), ("torch", TorchDDP)):
        torch.manual_seed(0)
        model = UnusedBranch()
        kwargs = {"find_unused_parameters": True, "skip_all_reduce_unused_params": skip, "bucket_cap_mb": 0.0001}
        ddp = wrapper(model, **kwargs)

        def train(ddp: Any = ddp, model: Any = model) -> dict:
            for i in range(3):
                x, y = global_batch("mlp", world, i)
                loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            return grads_of(model)

        results[name], counts[name] = _count_all_reduces(train)
        if wrapper is DDP:
            unused = {"unused.weight", "unused.bias", "sometimes.weight", "sometimes.bias"}
            names = ddp.engine.names
            storages = ddp.engine.buckets.storages
            all_unused = sum(all(names[i] in unused for i in s.param_indices) for s in storages)
    return {"results": results, "gradsync_all_reduces": counts["gradsync"], "all_unused_buckets": all_unused}


def test_skip_all_reduce_unused_params_matches_torch_and_skips_collectives() -> None:
    with_skip = run_distributed(_skip_unused, 2, True)
    without = run_distributed(_skip_unused, 2, False)
    for result in with_skip:
        ours, theirs = result["results"]["gradsync"], result["results"]["torch"]
        for name in ours:
            assert (ours[name] is None) == (theirs[name] is None), name
            if ours[name] is not None:
                assert torch.allclose(ours[name], theirs[name], atol=1e-6), name
        assert ours["unused.weight"] is None and ours["sometimes.weight"] is None
    # Per iteration, one all-reduce fewer per bucket that holds only unused parameters.
    skipped = with_skip[0]["all_unused_buckets"]
    assert skipped >= 1
    assert with_skip[0]["gradsync_all_reduces"] == without[0]["gradsync_all_reduces"] - 3 * skipped


# ---------------------------------------------------------------- delay_all_reduce_named_params
def _delayed(hook_name: str, delayed_prefix: str) -> dict:
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    named = dict(model.named_parameters())
    delayed = [(n, p) for n, p in model.named_parameters() if n.startswith(delayed_prefix)]
    ddp = DDP(model, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=named[hook_name])
    order = [[ddp.engine.names[i] for i in s.param_indices] for s in ddp.engine.buckets.storages]
    for i in range(3):  # the third iteration runs on the rebuilt buckets
        x, y = global_batch("mlp", world, i)
        model.zero_grad()
        ref.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        reference_step(ref, x, y, world)
    close = all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters()))
    return {"close": close, "buckets": order}


@pytest.mark.parametrize(
    ("hook_name", "delayed_prefix"),
    [
        ("layers.0.0.weight", "head."),  # torch's intended use: the delayed gradients are ready first
        ("head.weight", "layers.0."),  # torch fires before the delayed gradients exist (NOTES §1j.4)
    ],
)
def test_delayed_all_reduce_waits_for_its_gradients_and_the_hook_parameter(hook_name: str, delayed_prefix: str) -> None:
    for result in run_distributed(_delayed, 2, hook_name, delayed_prefix):
        assert result["close"], "delayed parameters were not averaged"
        delayed_bucket = next(b for b in result["buckets"] if b[0].startswith(delayed_prefix))
        assert all(n.startswith(delayed_prefix) for n in delayed_bucket)  # a bucket of their own
        hook_bucket = next(i for i, b in enumerate(result["buckets"]) if hook_name in b)
        assert result["buckets"].index(delayed_bucket) >= hook_bucket


def _delayed_like_torch() -> bool:
    rank, world = rank_world()
    models = []
    for wrapper in (DDP, TorchDDP):
        torch.manual_seed(0)
        model = MLP()
        delayed = [(n, p) for n, p in model.named_parameters() if n.startswith("head.")]
        hook = dict(model.named_parameters())["layers.0.0.weight"]
        ddp = wrapper(model, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            x, y = global_batch("mlp", world, i)
            opt.zero_grad()
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            dist.barrier()  # torch never waits for its delayed all-reduce; let it land
            opt.step()
        models.append(model)
    return all(torch.allclose(p, q, atol=1e-6) for p, q in zip(models[0].parameters(), models[1].parameters()))


def test_delayed_all_reduce_matches_torch_where_torch_is_right() -> None:
    assert all(run_distributed(_delayed_like_torch, 2))


def _skip_under_join() -> str:
    ddp = DDP(UnusedBranch(), find_unused_parameters=True, skip_all_reduce_unused_params=True)
    with pytest.raises(RuntimeError, match="skip_all_reduce_unused_params cannot be combined with join") as error:
        with ddp.join():
            pass
    return str(error.value)


def test_skip_all_reduce_unused_params_refuses_join() -> None:
    """A joined rank shadows every bucket; the ranks still training would skip some: mismatched collectives."""
    run_distributed(_skip_under_join, 2)
