"""Cast-based compression: all-reduce gradients in fp16 or bf16, halving the bytes.

``fp16_compress_hook`` and ``bf16_compress_hook`` are the usual entry points;
``compress_wrapper(hook, dtype)`` puts the same cast around any other hook (PowerSGD in
bf16, say).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..engine.grad_bucket import GradBucket
from .allreduce import GroupOrState, allreduce_future, end_bucket, first_tensor, resolve

Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


def _cast_hook(state: GroupOrState, bucket: GradBucket, dtype: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    group, world_size, wire = resolve(state)
    buffer = bucket.buffer()
    if buffer.is_sparse or buffer.dtype == dtype:
        fut = allreduce_future(buffer, group, world_size, wire)
        end_bucket(wire, bucket)
        return fut
    # Divide in the gradient's own precision, then cast: one rounding instead of two, and a
    # value up to W times fp16's maximum still fits once it is averaged.
    compressed = buffer.div_(world_size).to(dtype)
    fut = allreduce_future(compressed, group, world_size, wire, divide=False)
    end_bucket(wire, bucket)

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(first_tensor(fut))
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(process_group_or_state: GroupOrState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in float16: half the bytes of fp32, about 3 decimal digits kept.

    When to use it: bandwidth-bound fp32 training whose gradients sit comfortably inside
    fp16's range (about 6e-5 to 6.5e4 for full precision). Gradients below ~6e-8 flush to
    zero and below ~6e-5 lose relative precision, so models with tiny gradients (large
    embedding tables, loss-scaled mixed precision before unscaling) prefer
    ``bf16_compress_hook``. Nothing to tune; no memory across iterations.

    Bytes on the wire: half of ``allreduce_hook`` for fp32 buckets (a quarter for fp64);
    buckets already in fp16, and sparse buckets, are all-reduced unchanged. The bucket is
    divided by the world size before the cast, so the sum cannot overflow where the average
    would not. ``process_group_or_state`` is as for ``allreduce_hook``.
    """
    return _cast_hook(process_group_or_state, bucket, torch.float16)


def bf16_compress_hook(process_group_or_state: GroupOrState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16: half the bytes of fp32, fp32's range, ~2-3 digits.

    When to use it: like ``fp16_compress_hook`` but when gradients span a wide range of
    magnitudes; bf16 keeps fp32's exponent (no underflow or overflow worries) and pays with
    a coarser mantissa (relative error up to 2**-8 per element instead of 2**-11). SGD and
    Adam usually do not notice; if training becomes noisier, fp16 (when the range allows)
    or error-feedback hooks are the next step.

    Bytes on the wire: half of ``allreduce_hook`` for fp32 buckets.
    ``process_group_or_state`` is as for ``allreduce_hook``.
    """
    return _cast_hook(process_group_or_state, bucket, torch.bfloat16)


def compress_wrapper(hook: Hook, dtype: torch.dtype) -> Hook:
    """Run ``hook`` on a ``dtype`` copy of each bucket and write its result back.

    The wrapper casts the buffer with ``bucket.set_buffer(buffer.to(dtype))``, runs the
    inner hook (which sees, reduces and divides the cast buffer), and copies the inner
    result into the original buffer. Use it to stack compressions: for example
    ``compress_wrapper(powersgd_hook, torch.bfloat16)`` halves PowerSGD's P and Q traffic.
    ``compress_wrapper(allreduce_hook, torch.float16)`` is ``fp16_compress_hook`` except
    that the inner hook divides after the cast (two roundings, not one).

    Bytes on the wire: whatever the inner hook sends, at ``dtype``'s element size. Sparse
    buckets and buckets already in ``dtype`` go to the inner hook untouched.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"compress_wrapper needs a floating dtype such as torch.bfloat16, got {dtype}.")

    @functools.wraps(hook)
    def wrapped(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if buffer.is_sparse or buffer.dtype == dtype:
            return hook(state, bucket)
        bucket.set_buffer(buffer.to(dtype))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
            buffer.copy_(first_tensor(fut))
            return buffer

        return fut.then(decompress)

    name = getattr(hook, "__qualname__", repr(hook))
    wrapped.__qualname__ = wrapped.__name__ = f"compress_wrapper({name}, {dtype})"
    return wrapped
