"""8-bit quantisation: send each gradient entry as one signed byte plus a shared scale.

Per bucket, the ranks agree on one scale ``s`` (the largest magnitude on any rank, via
an all-reduce of one number), quantise ``q = round(g / s * 127)`` to int8, all-gather the
int8 tensors, and average ``sum(q) * s / 127 / W``. The rounding error stays in the
rank's error memory and is added to the next gradient.

[Note: why all-gather, and why sum in int32]
Summing int8 on the wire overflows after two ranks (127 + 127), and process groups
reduce in the tensor's own dtype; so the int8 tensors are gathered and summed locally in
int32, which is exact for any realistic world size. The sum is divided by ``W`` in the
final multiply; nothing is summed in a narrow float type, so nothing can overflow.
(torch's quantization hooks read the all-gather's future, whose layout differs between
backends; this hook reads its own output list instead.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .allreduce import end_bucket
from .memory import BucketMemory, start_with_error_feedback
from .wire import WireStats

LEVELS = 127  # int8 range used symmetrically: -127..127, so 0 is exact and sign is symmetric


class Int8State:
    """Knobs and error memories of ``int8_hook``.

    ``errors`` holds each bucket's quantisation residual, keyed by ``bucket.index()``;
    ``wire`` records the bytes this rank sent per iteration.
    """

    __slots__ = ("process_group", "world_size", "error_feedback", "errors", "wire")

    def __init__(self, process_group: dist.ProcessGroup | None, error_feedback: bool = True) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.error_feedback = error_feedback
        self.errors = BucketMemory()
        self.wire = WireStats(self.world_size)


def int8_hook(state: Int8State, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send each entry as int8 with one scale per bucket; feed back the rounding error.

    When to use it: a few ranks on a slow network, when bf16's factor of two is not
    enough and the model has no large outliers in its gradients. One scale per bucket
    means an entry over 254 times smaller than the bucket's largest rounds to zero (and
    only arrives later, through error feedback); smaller buckets (``bucket_cap_mb``) give
    each scale fewer entries to cover and so finer steps.

    The knob: ``error_feedback`` keeps the rounding residual and adds it to the next
    gradient, which makes the quantisation unbiased over time. Leave it on; it costs one
    bucket-sized tensor per bucket.

    Per entry the average is within ``s / 127 / 2`` of the true average (``s`` the
    scale); with error feedback the residual is carried, not lost.

    Bytes on the wire per rank: ``(W - 1) n`` (int8 all-gather) plus a 4-byte scale
    all-reduce, against ``2 (W - 1) / W * 4 n`` for fp32 all-reduce: four times less at
    ``W = 2``, ``8 / W`` times less in general, so it stops paying off at 8 ranks (use
    ``bf16_compress_hook`` there). The hook waits for the scale's all-reduce (one small,
    latency-bound round trip per bucket) before it can quantise. Sparse buckets are
    all-reduced unchanged.
    """
    group, world_size = state.process_group, state.world_size
    sparse_future, buffer, error = start_with_error_feedback(state, bucket)
    if sparse_future is not None:
        return sparse_future
    # The shared scale: issued and waited for here, not in a callback, so every rank issues
    # its collectives in bucket order (see powersgd.py's [Note: collective order]).
    scale = buffer.abs().amax().float().reshape(1)
    state.wire.add_all_reduce(scale)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=group)
    step = (scale / LEVELS).to(buffer.dtype).clamp_min(torch.finfo(buffer.dtype).tiny)  # all-zero bucket: no 0/0
    quantised = torch.round(buffer / step).clamp_(-LEVELS, LEVELS).to(torch.int8)
    if state.error_feedback:
        residual = buffer - quantised.to(buffer.dtype) * step
        if error is None:
            state.errors.store(bucket, residual)
        else:
            error.copy_(residual)
    gathered = [torch.empty_like(quantised) for _ in range(world_size)]
    state.wire.add_all_gather(quantised)
    work = dist.all_gather(gathered, quantised, group=group, async_op=True)
    end_bucket(state.wire, bucket)

    def dequantise(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.value()  # re-raises a failed all-gather
        # Summed in place into one int32 tensor: no world-size-times-bucket stack (300 vs 70 ms
        # for a 16.8M-element bucket at two ranks, 2026-11-30-hooks.md); integer sums are exact,
        # so the order does not change a bit.
        total = gathered[0].to(torch.int32)
        for part in gathered[1:]:
            total.add_(part)
        torch.mul(total.to(buffer.dtype), step / world_size, out=buffer)
        return buffer

    future: torch.futures.Future[torch.Tensor] = work.get_future().then(dequantise)
    return future
