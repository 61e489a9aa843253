"""World size 1 on NCCL: gradsync's plumbing on a real GPU, bitwise against a local backward.

At world size 1 an NCCL all-reduce is a device-to-device copy and gradsync divides by nothing, so
every option must give the local gradients *exactly*; a wrong dtype, device, view, stash or copy
shows as a difference. It cannot show a missing stream wait (the identity reads what it is given):
that is test_gpu_stream_order.py's job. Also here: no host synchronisation on the plain path, at most
one with find_unused_parameters, the inputs' host-to-device copy, the CUDA-event timings, mixed
precision and the sharded optimizer.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
from gpu_models import CUDA, NO_CUDA, assert_same_grads, batch, forward_kwargs, model_and_reference, no_host_sync
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel.distributed import _MixedPrecision

import gradsync
from gradsync import DistributedDataParallel as DDP
from gradsync import hooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

GRID = [
    (model, as_view, find_unused, static, no_sync, hook)
    for model, as_view, find_unused, static, no_sync, hook in itertools.product(
        ["mlp", "conv_bn", "unused"],
        [False, True],
        [False, True],
        [False, True],
        [False, True],
        [None, "gradsync", "torch"],
    )
    if (model != "unused" or find_unused or static) and (hook is None or not (find_unused or static))
]


def _hook(ddp: DDP, hook: str | None) -> None:
    if hook == "gradsync":
        ddp.register_comm_hook(hooks.AllReduceState(dist.group.WORLD), hooks.allreduce_hook)
    elif hook == "torch":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)


@pytest.mark.parametrize("model_name,as_view,find_unused,static,no_sync,hook", GRID)
def test_parity_with_local_backward(nccl_world, model_name, as_view, find_unused, static, no_sync, hook) -> None:
    model, reference = model_and_reference(model_name)
    ddp = DDP(model, gradient_as_bucket_view=as_view, find_unused_parameters=find_unused, static_graph=static)
    _hook(ddp, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    what = f"{model_name} as_view={as_view} find_unused={find_unused} static={static} no_sync={no_sync} hook={hook}"
    for step in range(4):  # the third and fourth run on rebuilt buckets
        x, y = batch(model_name, step)
        kwargs = forward_kwargs(model_name, step) if not static else {}
        if no_sync and step % 2 == 0:
            with ddp.no_sync():  # accumulated locally, averaged by the next synced backward
                torch.nn.functional.mse_loss(ddp(x, **kwargs), y).backward()
            torch.nn.functional.mse_loss(reference(x, **kwargs), y).backward()
            continue
        torch.nn.functional.mse_loss(ddp(x, **kwargs), y).backward()
        torch.nn.functional.mse_loss(reference(x, **kwargs), y).backward()
        assert_same_grads(model, reference, f"{what}, step {step}")
        if as_view:
            _check_aliasing(ddp, what)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad(set_to_none=step % 3 == 0)
        reference_optimizer.zero_grad(set_to_none=step % 3 == 0)


def _check_aliasing(ddp: DDP, what: str) -> None:
    """With gradient_as_bucket_view a .grad in a bucket of several lies in that bucket's flat buffer."""
    for storage in ddp.engine.buckets.storages:
        if len(storage.params) < 2:
            continue
        flat = storage.flat.untyped_storage().data_ptr()
        for param in storage.params:
            if param.grad is not None:
                assert param.grad.untyped_storage().data_ptr() == flat, f"{what}: a .grad is not its bucket view"


@pytest.mark.parametrize("as_view", [False, True])
def test_plain_path_never_synchronises_the_host(nccl_world, as_view: bool) -> None:
    model, _ = model_and_reference("conv_bn")
    ddp = DDP(model, gradient_as_bucket_view=as_view)
    for step in range(3):  # past the rebuild, and the clock's first passes
        x, y = batch("conv_bn", step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    x, y = batch("conv_bn", 3)
    with no_host_sync():  # forward (buffer broadcast), backward, every bucket, finalize, timing events
        for _ in range(2):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            ddp.stats()  # reading the timings does not wait either


def _syncs_per_step(wrapper, steps: int = 3) -> float:  # noqa: ANN001
    model, _ = model_and_reference("unused")
    ddp = wrapper(model, find_unused_parameters=True)
    for step in range(3):
        x, y = batch("unused", step)
        torch.nn.functional.mse_loss(ddp(x, **forward_kwargs("unused", step)), y).backward()
    x, y = batch("unused", 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                torch.nn.functional.mse_loss(ddp(x, **forward_kwargs("unused", step)), y).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def test_find_unused_synchronises_at_most_as_often_as_torch(nccl_world) -> None:
    ours = _syncs_per_step(DDP)
    theirs = _syncs_per_step(torch.nn.parallel.DistributedDataParallel)
    assert ours <= max(theirs, 1.0), f"gradsync: {ours} host synchronisations per step, torch's DDP {theirs}"


def test_pinned_input_may_be_reused_once_forward_returns(nccl_world) -> None:
    """[Note: host-to-device copies of inputs]: a busy stream, a pinned input overwritten at once."""
    model, reference = model_and_reference("mlp")
    ddp = DDP(model, device_ids=[0])
    x, y = batch("mlp", 0, device=torch.device("cpu"))
    pinned = x.pin_memory()
    torch.cuda._sleep(200_000_000)  # the current stream is busy for ~100 ms: a queued copy would wait
    out = ddp(pinned)
    pinned.fill_(float("nan"))  # the data loader's next batch lands in the same buffer
    expected = reference(x.to(CUDA))
    assert torch.equal(out, expected), "the forward read the pinned buffer after it was overwritten"


def test_stats_are_cuda_event_times(nccl_world) -> None:
    model, _ = model_and_reference("mlp")
    ddp = DDP(model, bucket_cap_mb=1e-3)
    for step in range(5):
        x, y = batch("mlp", step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    torch.cuda.synchronize()
    stats = ddp.stats()
    assert stats.timing == "CUDA events" and stats.iterations == 5, str(stats)
    assert stats.avg_backward_s > 0 and stats.avg_forward_s > 0
    assert all(b.launches >= 1 for b in stats.buckets), str(stats)


def test_completions_are_sampled_but_every_reduction_counted(nccl_world) -> None:
    """[Note: sampled bucket completions]: past the first passes only the last bucket's completion is timed
    every iteration; every bucket still counts every reduction and has a reduce time."""
    model, _ = model_and_reference("mlp")
    ddp = DDP(model, bucket_cap_mb=1e-3)
    steps = 40
    for step in range(steps):
        x, y = batch("mlp", step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    torch.cuda.synchronize()
    stats = ddp.stats()
    assert stats.iterations == steps and len(stats.buckets) > 1, str(stats)
    assert all(b.launches == steps - 1 for b in stats.buckets), str(stats)  # counted since the rebuild
    assert all(b.avg_reduce_s > 0 for b in stats.buckets), str(stats)
    timed = [b.timed for b in stats.buckets]
    assert timed[-1] == steps - 1 and all(t < steps - 1 for t in timed[:-1]), timed  # sampling happened


def test_a_lone_buckets_buffer_takes_no_gpu_memory(nccl_world) -> None:
    """A gradient reduced in its own .grad leaves its bucket's flat buffer unallocated on the GPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4)).to(CUDA)  # 4 MiB weight
    for as_view in (False, True):
        ddp = DDP(model, bucket_cap_mb=1, gradient_as_bucket_view=as_view)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            ddp(torch.randn(8, 1024, device=CUDA)).sum().backward()
        lone = [s for s in ddp.engine.buckets.storages if len(s.params) == 1 and s.params[0] is model[0].weight]
        assert lone and not lone[0].allocated, f"as_view={as_view}: the lone bucket's buffer holds GPU memory"


def test_mixed_precision_matches_a_local_bf16_backward(nccl_world) -> None:
    model, reference = model_and_reference("mlp")
    ddp = DDP(model, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    for step in range(3):
        x, y = batch("mlp", step)
        model.zero_grad()
        reference.zero_grad()
        torch.nn.functional.mse_loss(ddp(x).float(), y).backward()
        low = {n: p.to(torch.bfloat16) for n, p in reference.named_parameters()}
        out = torch.func.functional_call(reference, low, (x.to(torch.bfloat16),))
        torch.nn.functional.mse_loss(out.float(), y).backward()
        assert_same_grads(model, reference, f"mixed precision step {step}")


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_optimizer_steps_like_a_local_one(nccl_world, stage: int) -> None:
    from gradsync.zero import ShardedOptimizer

    model, reference = model_and_reference("mlp")
    ddp = DDP(model)
    sharded = ShardedOptimizer(ddp, torch.optim.SGD, stage=stage, lr=0.1)
    local = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch("mlp", step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        sharded.step()
        local.step()
        sharded.zero_grad()
        local.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"stage {stage} {name}: {m}")


def test_gradsync_version_and_devices(nccl_world) -> None:
    """The probe: what this machine is (also written by run_on_device.sh)."""
    assert torch.cuda.device_count() >= 1 and gradsync.__version__
    assert dist.get_backend() == "nccl"
