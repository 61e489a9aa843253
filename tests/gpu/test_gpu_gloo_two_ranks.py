"""Two processes x gloo x CUDA tensors on one GPU: real cross-rank sums on the GPU, against torch's DDP.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo reduces CUDA tensors through host
copies, its side streams waiting for the stream current at the call and ``wait()`` making the caller's
stream wait (ProcessGroupGlooCuda.cpp). Each rank trains on its own batches; gradsync and torch's DDP,
built from the same weights in the same processes, must give the same gradients bitwise (both divide
by two before the sum, and a sum of two is the same in either order). Also: uneven inputs under join,
and gradsync's SyncBatchNorm against BatchNorm over the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_models import CUDA, NO_CUDA, ConvBN, batch, deterministic_kernels, forward_kwargs, model_and_reference
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as DDP

from harness import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def _against_torch(name: str, as_view: bool, find_unused: bool) -> int:
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    deterministic_kernels()
    model, twin = model_and_reference(name)
    options = {"gradient_as_bucket_view": as_view, "find_unused_parameters": find_unused, "bucket_cap_mb": 0.004}
    ours, theirs = DDP(model, **options), TorchDDP(twin, **options)
    for step in range(5):
        x, y = batch(name, 10 * step + rank)  # each rank its own batch
        kwargs = forward_kwargs(name, step)
        for ddp in (ours, theirs):
            ddp.zero_grad(set_to_none=step % 2 == 0)
            F.mse_loss(ddp(x, **kwargs), y).backward()
        for (param_name, p), q in zip(model.named_parameters(), twin.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), f"rank {rank} step {step}: {param_name}"
                continue
            assert p.grad is not None and torch.equal(p.grad, q.grad), f"rank {rank} step {step}: {param_name}"
    return rank


@pytest.mark.parametrize("name,find_unused", [("mlp", False), ("conv_bn", False), ("unused", True)])
@pytest.mark.parametrize("as_view", [False, True])
def test_same_gradients_as_torch_ddp(name: str, find_unused: bool, as_view: bool) -> None:
    assert run_distributed(_against_torch, 2, name, as_view, find_unused, timeout_s=180) == [0, 1]


def _uneven_inputs() -> None:
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    deterministic_kernels()
    model, twin = model_and_reference("mlp")
    ours, theirs = DDP(model), TorchDDP(twin)
    for ddp, params in ((ours, model.parameters()), (theirs, twin.parameters())):
        optimizer = torch.optim.SGD(params, lr=0.1)
        with ddp.join():
            for step in range(4 + rank):  # rank 1 has one batch more
                x, y = batch("mlp", 10 * step + rank)
                optimizer.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                optimizer.step()
    for (param_name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"rank {rank}: {param_name} after join differs from torch's DDP"


def test_join_with_uneven_inputs_like_torch_ddp() -> None:
    run_distributed(_uneven_inputs, 2, timeout_s=180)


def _sync_batchnorm() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    local = ConvBN().to(CUDA)
    reference = copy.deepcopy(local)
    model = gradsync.SyncBatchNorm.convert_sync_batchnorm(local)
    ddp = DDP(model)
    xs = [batch("conv_bn", r)[0] for r in range(world)]  # every rank's batch, known to all
    out = ddp(xs[rank])
    expected = reference(torch.cat(xs))  # BatchNorm over the whole batch: what SyncBatchNorm computes
    torch.testing.assert_close(out, expected.chunk(world)[rank], rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    expected.square().mean().backward()  # the mean over every rank's outputs: what DDP's average gives
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_sync_batchnorm_matches_batchnorm_over_the_whole_batch() -> None:
    run_distributed(_sync_batchnorm, 2, timeout_s=180)
