"""Misuse gets a clear error naming what, where and how to fix it."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import MLP, global_batch, loss_fn, rank_world, shard


def _mismatched_shapes() -> str:
    rank, _ = rank_world()
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4 if rank == 0 else 5))
    with pytest.raises(RuntimeError, match="^DDP expects same model across all ranks") as error:
        DDP(model)
    return str(error.value)


def test_parameter_shape_mismatch_is_reported_on_every_rank() -> None:
    for message in run_distributed(_mismatched_shapes, 2):
        assert "'1.weight'" in message and "rank 1" in message
        assert "shape (4, 16) vs (5, 16)" in message


def _mismatched_count() -> str:
    rank, _ = rank_world()
    layers = [nn.Linear(4, 4) for _ in range(2 + rank)]
    with pytest.raises(RuntimeError, match="^DDP expects same model across all ranks") as error:
        DDP(nn.Sequential(*layers))
    return str(error.value)


def test_parameter_count_mismatch_is_reported_on_every_rank() -> None:
    for message in run_distributed(_mismatched_count, 3):
        assert "rank 0 wraps 4 parameters but rank 1 wraps 6" in message
        assert "rank 0 wraps 4 parameters but rank 2 wraps 8" in message
        assert "'2.weight'" in message


def _constructor_validation() -> None:
    trainable = MLP()
    frozen = MLP().requires_grad_(False)
    cases = [
        (RuntimeError, "^DistributedDataParallel is not needed when a module doesn't have any", lambda: DDP(frozen)),
        (ValueError, r"only work with .* device_ids=\[0\] for a CPU module", lambda: DDP(trainable, device_ids=[0])),
        (ValueError, "output_device=0 for a CPU module", lambda: DDP(trainable, output_device=0)),
        (ValueError, "^device_ids can only be None or contain a single", lambda: DDP(trainable, device_ids=[0, 1])),
        (ValueError, "bucket_cap_mb must be a positive", lambda: DDP(trainable, bucket_cap_mb=0)),
        (ValueError, "bucket_cap_mb must be a positive", lambda: DDP(trainable, bucket_cap_mb=-1)),
        (ValueError, "bucket_cap_mb_list", lambda: DDP(trainable, bucket_cap_mb_list=[])),
        (
            RuntimeError,
            "^Modules with uninitialized parameters can't be used .* not initialized yet",
            lambda: DDP(nn.Sequential(nn.LazyLinear(4))),
        ),
        (TypeError, "mixed_precision must have param_dtype", lambda: DDP(trainable, mixed_precision=object())),
        (
            TypeError,
            "mixed_precision.param_dtype must be a floating torch.dtype",
            lambda: DDP(trainable, mixed_precision=_MixedPrecision(param_dtype=torch.int8)),
        ),
        (
            ValueError,
            "gradient_as_bucket_view=True cannot be combined with mixed_precision",
            lambda: DDP(trainable, mixed_precision=_MixedPrecision(torch.bfloat16), gradient_as_bucket_view=True),
        ),
        (ValueError, "given together", lambda: DDP(trainable, delay_all_reduce_named_params=[])),
        (
            ValueError,
            "param_to_hook_all_reduce must be a trainable, non-ignored parameter",
            lambda: DDP(trainable, delay_all_reduce_named_params=[], param_to_hook_all_reduce=object()),
        ),
        (
            ValueError,
            "names 'other', which is not a trainable",
            lambda: DDP(
                trainable,
                delay_all_reduce_named_params=[("other", nn.Parameter(torch.zeros(1)))],
                param_to_hook_all_reduce=trainable.head.weight,
            ),
        ),
        (
            RuntimeError,
            "^Cannot specify both process_group and device_mesh",
            lambda: DDP(trainable, process_group=dist.group.WORLD, device_mesh=object()),
        ),
        (
            ValueError,
            "^SyncBatchNorm layers only work with GPU modules.*'1' is torch.nn.SyncBatchNorm",
            lambda: DDP(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))),
        ),
    ]
    for exc_type, text, build in cases:
        with pytest.raises(exc_type, match=text):
            build()
    # Both deprecations point at the line that built the wrapper (the caller's), as warnings should.
    with pytest.warns(FutureWarning, match="check_reduction") as caught:
        line = inspect.currentframe().f_lineno + 1
        DDP(MLP(), check_reduction=True)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    with pytest.warns(FutureWarning, match="broadcast_buffers is deprecated") as caught:
        line = inspect.currentframe().f_lineno + 1
        DDP(MLP(), broadcast_buffers=True)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DDP(MLP())  # the defaults warn about nothing


def test_constructor_validation() -> None:
    run_distributed(_constructor_validation, 2)


_WRAP_BEFORE_INIT = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from gradsync import DistributedDataParallel as DDP
for cls in (TorchDDP, DDP):
    try:
        cls(torch.nn.Linear(2, 2))
    except Exception as error:
        print(cls.__module__, type(error).__name__, str(error).replace(chr(10), " "))
"""


def test_wrapping_before_init_process_group_raises_torch_s_error() -> None:
    """Same class and leading wording as torch's DDP (which code matches on), then gradsync's fix."""
    out = subprocess.run([sys.executable, "-c", _WRAP_BEFORE_INIT], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    torch_module, torch_type, torch_text = lines[0].split(" ", 2)
    ours_module, ours_type, ours_text = lines[1].split(" ", 2)
    assert torch_module.startswith("torch.") and ours_module == "gradsync.ddp"
    assert ours_type == torch_type == "ValueError"
    assert torch_text.startswith("Default process group has not been initialized, please make sure to call")
    assert ours_text.startswith(torch_text.rstrip("."))
    assert "init_process_group() (torchrun sets the environment for it) before wrapping" in ours_text


def _requires_grad_toggled() -> str:
    rank, world = rank_world()
    model = MLP()
    ddp = DDP(model)
    x, y = global_batch("mlp", world, 0)
    loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    model.layers[0][0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError) as error:
        ddp(shard(x, rank, world))
    return str(error.value)


def test_requires_grad_toggled_after_wrapping_raises() -> None:
    for rank, message in enumerate(run_distributed(_requires_grad_toggled, 2)):
        assert "['layers.0.0.weight']" in message and f"rank {rank}" in message
        assert "wrap the model again" in message


def _comm_hook_registration() -> None:
    rank, world = rank_world()

    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def bad_annotation(state, bucket: int):
        return None

    ddp = DDP(MLP())
    with pytest.raises(TypeError, match="^Communication hook must be callable. Got int"):
        ddp.register_comm_hook(None, 42)
    with pytest.raises(ValueError, match="^Communication hook: bucket annotation should be dist.GradBucket"):
        ddp.register_comm_hook(None, bad_annotation)
    ddp.register_comm_hook(None, hook)
    with pytest.raises(RuntimeError, match="^register_comm_hook or register_builtin_comm_hook can only be called once"):
        ddp.register_comm_hook(None, hook)
    late = DDP(MLP())
    x, y = global_batch("mlp", world, 0)
    loss_fn(late(shard(x, rank, world)), shard(y, rank, world)).backward()
    with pytest.raises(RuntimeError, match="after training started"):
        late.register_comm_hook(None, hook)


def test_comm_hook_registration_errors() -> None:
    run_distributed(_comm_hook_registration, 2)


def _hook_exception_reaches_backward() -> str:
    rank, world = rank_world()

    def exploding_hook(state, bucket):
        raise ValueError("boom in hook")

    ddp = DDP(MLP())
    ddp.register_comm_hook(None, exploding_hook)
    x, y = global_batch("mlp", world, 0)
    with pytest.raises(ValueError, match="^boom in hook") as error:  # the hook's own exception, as torch
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return " ".join(getattr(error.value, "__notes__", []))


def test_exception_in_comm_hook_reaches_backward_as_itself_with_context() -> None:
    for rank, note in enumerate(run_distributed(_hook_exception_reaches_backward, 2)):
        assert "exploding_hook" in note and "bucket 0" in note and f"rank {rank}" in note
