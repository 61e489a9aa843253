"""Top-k sparsification: send only the largest gradient entries, keep the rest for later.

Each rank picks the ``k`` entries of its bucket with the largest magnitude (after adding
what it held back last time), and all ranks all-gather those ``(index, value)`` pairs.
Every rank then adds all the pairs into a dense zero tensor, in rank order, and has the
same sparse average. The entries not sent stay in the rank's error memory.

[Note: why all-gather]
Different ranks pick different indices, so the payloads cannot be summed element-wise
on the way (as an all-reduce does). An all-gather moves every rank's pairs to every
rank; its cost per rank grows with the world size (see ``wire.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..engine.grad_bucket import GradBucket
from .allreduce import end_bucket
from .memory import BucketMemory, start_with_error_feedback
from .wire import WireStats

SAMPLED_MIN_NUMEL = 1 << 20  # below this, plain topk is as fast
SAMPLE_SIZE = 1 << 16  # entries looked at to guess the threshold
OVERSAMPLE = 2.0  # aim for twice k candidates, so the guess is rarely too high


def largest_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest entries of a 1-D tensor: the set ``torch.topk`` picks, up to ties.

    [Note: top-k by a sampled threshold]
    ``topk`` over a 16.8M-element bucket takes ~330 ms on one CPU thread here (this: ~60 ms). A strided
    sample guesses a threshold that about ``OVERSAMPLE * k`` entries exceed; ``topk`` then
    runs only over those candidates. Every entry left out is below every candidate, so when
    there are at least ``k`` candidates their top ``k`` is the exact answer; otherwise (an
    unlucky sample, NaNs) we fall back to ``topk`` over everything. Always exactly ``k``
    indices, which the fixed-size all-gather needs.
    """
    n = magnitude.numel()
    stride = max(1, n // SAMPLE_SIZE)
    sample = magnitude[::stride]
    above = math.ceil(OVERSAMPLE * k * sample.numel() / n)  # sample entries to leave above the guess
    if n < SAMPLED_MIN_NUMEL or above >= sample.numel():
        return magnitude.topk(k, sorted=False).indices
    threshold = sample.kthvalue(sample.numel() - above).values
    candidates = (magnitude > threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


class TopKState:
    """Knobs and error memories of ``topk_hook``.

    ``errors`` holds each bucket's unsent residual, keyed by ``bucket.index()``; ``wire``
    records the bytes this rank sent per iteration.
    """

    __slots__ = ("process_group", "world_size", "ratio", "error_feedback", "errors", "wire")

    def __init__(
        self, process_group: dist.ProcessGroup | None, ratio: float = 0.01, error_feedback: bool = True
    ) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"TopKState: ratio is the fraction of each bucket sent, in (0, 1]; got {ratio!r}.")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.errors = BucketMemory()
        self.wire = WireStats(self.world_size)

    def k_for(self, numel: int) -> int:
        """Entries sent for a bucket of ``numel``: the same on every rank, so shapes match."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))


def topk_hook(state: TopKState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the ``ratio`` largest-magnitude entries of each bucket; feed back the rest.

    When to use it: slow networks and few ranks, with models that tolerate delayed
    updates (most do with error feedback and SGD with momentum). With ``W`` ranks it
    all-gathers ``W k`` pairs, so its advantage over all-reduce shrinks as ``W`` grows:
    for fp32 it sends ``1 / (W ratio)`` times less, and more than plain beyond
    ``W = 1 / ratio`` (100 ranks at ratio 0.01).

    The knobs:

    * ``ratio``: fraction of each bucket sent (``k = ceil(ratio n)``). Lower sends less
      and delays more of the gradient; on the convergence test in
      ``tests/test_hooks_library.py`` 0.01 ends within 0.03 of plain SGD's loss.
      ``ratio=1.0`` sends everything and equals plain all-reduce.
    * ``error_feedback``: keep what was not sent and add it to the next gradient. Leave
      it on: without it, small but consistent gradients are never applied (on that test
      the loss stalls at 1.0 instead of 0.46). Costs one bucket-sized tensor per bucket.

    Bytes on the wire per rank: ``(W - 1) k (4 + s)`` for element size ``s`` (indices go
    as int32), against ``2 (W - 1) / W n s`` for all-reduce: at ``W = 2``, fp32 and
    ratio 0.01, 50 times less. Selecting the top k costs a pass over the bucket (a sort
    on some devices). Sparse buckets are all-reduced unchanged.
    """
    group, world_size = state.process_group, state.world_size
    sparse_future, buffer, error = start_with_error_feedback(state, bucket)
    if sparse_future is not None:
        return sparse_future
    n = buffer.numel()
    k = state.k_for(n)
    indices = largest_indices(buffer.abs(), k)
    values = buffer[indices]
    if state.error_feedback:
        if error is None:
            error = buffer.clone()
            state.errors.store(bucket, error)
        else:
            error.copy_(buffer)
        error[indices] = 0  # what was sent is no longer owed
    # Divide before the sum (the summed average cannot overflow where the sum could);
    # int32 indices halve the index bytes and hold any bucket below 2**31 elements.
    values.div_(world_size)
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    indices = indices.to(index_dtype)
    gathered_indices = [torch.empty_like(indices) for _ in range(world_size)]
    gathered_values = [torch.empty_like(values) for _ in range(world_size)]
    state.wire.add_all_gather(indices)
    state.wire.add_all_gather(values)
    index_work = dist.all_gather(gathered_indices, indices, group=group, async_op=True)
    value_work = dist.all_gather(gathered_values, values, group=group, async_op=True)
    end_bucket(state.wire, bucket)

    def densify(fut: torch.futures.Future[Any]) -> torch.Tensor:
        for f in fut.value():
            f.value()  # re-raises a failed all-gather
        buffer.zero_()
        # One index_add_ per rank, in rank order: a rank's indices are distinct, so even a
        # device that adds atomically adds in a fixed order, and every replica gets the same bits.
        for rank_indices, rank_values in zip(gathered_indices, gathered_values):
            buffer.index_add_(0, rank_indices.long(), rank_values)
        return buffer

    return torch.futures.collect_all([index_work.get_future(), value_work.get_future()]).then(densify)
