"""A reduce-scatter that costs what it should on gloo, and the all-gather that undoes it.

[Note: reduce-scatter from all_to_all]
gloo's ``reduce_scatter_single`` moves as many bytes as an all-reduce (it is one, then a chunk;
shared/zero/NOTES.md §1), so a reduce-scatter followed by an all-gather would cost 1.5 times
DDP's communication. ``all_to_all_single`` sends chunk ``r`` of a buffer to rank ``r`` and moves
``(N - 1) / N`` of it per rank, as a true reduce-scatter does; each rank then sums the ``N``
chunks it received itself, in rank order, so the result is deterministic (the same bits whatever
the bucket layout) and, at two ranks, bitwise the sum an all-reduce gives (``a + b == b + a``).
Reduce-scatter plus all-gather then move exactly what one all-reduce moves. On CPU (gloo) both are
point-to-point exchanges sent in segments ([Note: exchanges in segments] in segmented.py), which
run at the link's rate in both directions where one message per peer runs at half of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .segmented import exchanger, fold

# Whether gloo's exchanges go in segments ([Note: exchanges in segments]); False: one message per
# peer, as gloo's all_to_all_single and all-gather send them (the benchmarks compare both).
SEGMENTED = True


def summed_on_arrival(device: torch.device) -> bool:
    """Whether a reduce-scatter on ``device`` is summed as its segments arrive (gloo, on CPU), so that
    nothing is received whole; elsewhere ``all_to_all_single`` needs a receive buffer."""
    return SEGMENTED and device.type == "cpu"


# torch 2.13 names it all_gather_single; older releases (from 2.4) all_gather_into_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """The work of a finished reduce-scatter, once its handle (and the buffers it holds) was let go."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()


class PendingReduceScatter:
    """A reduce-scatter in flight into ``shard``; ``finish`` waits for it.

    On CPU the exchange's thread sums each segment into ``shard`` as it arrives
    ([Note: a reduce-scatter summed as it arrives] in segmented.py); elsewhere ``finish`` sums what
    ``all_to_all_single`` received.
    """

    __slots__ = ("work", "sent", "received", "shard", "accumulate", "world_size", "failed")

    def __init__(self, work: Any, sent: torch.Tensor, received: torch.Tensor | None, shard: torch.Tensor,
                 accumulate: bool, world_size: int) -> None:  # fmt: skip
        self.work = work
        self.sent = sent  # a cast copy must live until the send completed
        self.received = received  # None: summed on arrival
        self.shard, self.accumulate = shard, accumulate
        self.world_size = world_size
        self.failed = False  # finish raised: what reached the shard is not to be used

    def wait(self) -> None:
        self.work.wait()

    def finish(self) -> None:
        """Wait until ``shard`` holds (or, with ``accumulate``, has added) the sum of every rank's chunk, in rank order.

        The sum is in ``shard``'s dtype: chunks sent in a low precision add up in the gradients' own.
        """
        self.work.wait()
        if self.received is not None:
            fold(list(self.received.view(self.world_size, -1)), self.shard, self.accumulate)
        # Let the buffers go now: the work handle holds its tensors too, so it goes as well.
        self.received = None
        self.sent = self.shard = torch.empty(0, dtype=self.sent.dtype)
        self.work = _DONE


def start_reduce_scatter(
    padded: torch.Tensor,
    shard: torch.Tensor,
    accumulate: bool,
    group: dist.ProcessGroup,
    wire_dtype: torch.dtype | None = None,
    receive: torch.Tensor | None = None,
) -> PendingReduceScatter:
    """Start reducing ``padded`` (its length a multiple of the group's size) over ``group`` into ``shard``
    (``accumulate``: adding to what it holds), sent in ``wire_dtype``.

    ``receive``: off CPU, a buffer of the wire's dtype at least as long as ``padded`` to receive in
    (reused), or None for a fresh one. On CPU nothing is received whole."""
    sent = padded if wire_dtype is None or wire_dtype == padded.dtype else padded.to(wire_dtype)
    world_size = dist.get_world_size(group)
    if summed_on_arrival(sent.device):
        work = exchanger(group).reduce_scatter(list(sent.view(world_size, -1)), shard, accumulate)
        return PendingReduceScatter(work, sent, None, shard, accumulate, world_size)
    if receive is not None and receive.dtype == sent.dtype and receive.numel() >= sent.numel():
        received = receive.narrow(0, 0, sent.numel())
    else:
        received = torch.empty_like(sent)
    work = dist.all_to_all_single(received, sent, group=group, async_op=True)
    return PendingReduceScatter(work, sent, received, shard, accumulate, world_size)


class PendingGather:
    """An all-gather sent in another dtype than ``output``'s: ``wait`` copies the result in."""

    __slots__ = ("work", "output", "received", "sent")

    def __init__(self, work: Any, output: torch.Tensor, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.work, self.output, self.received, self.sent = work, output, received, sent

    def wait(self) -> None:
        self.work.wait()
        self.output.copy_(self.received)

    def is_completed(self) -> bool:
        done: bool = self.work.is_completed()
        return done


def start_all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, wire_dtype: torch.dtype | None = None
) -> Any:
    """Start filling ``output`` (``world_size`` times ``shard``'s length) with every rank's shard, in rank order.

    Sent in ``wire_dtype`` (default: ``output``'s); either way ``wait()`` leaves the result in ``output``.
    """
    wire = wire_dtype or output.dtype
    if wire == output.dtype and shard.dtype == wire:
        return _gather(output, shard, group)
    sent = shard.to(wire)
    received = output if output.dtype == wire else torch.empty(output.shape, dtype=wire, device=output.device)
    return PendingGather(_gather(received, sent, group), output, received, sent)


def _gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> Any:
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if not SEGMENTED or output.device.type != "cpu":  # in place at any size: [Note: exchanges in segments]
        return _all_gather(output, shard, group=group, async_op=True)
    receives = output.view(world_size, -1)
    own = receives[rank]
    local = None if own.data_ptr() == shard.data_ptr() else (own, shard)  # in place: the shard is already there
    return exchanger(group).start([shard] * world_size, list(receives), local=local)
