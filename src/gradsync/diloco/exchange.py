"""The outer exchange: every replica's outer gradient in, their average out, the same bits everywhere.

[Note: the exchange, step by step]
One fragment's outer gradient ``delta`` (flat, fp32, ``n`` values) on every process:

1. island slice: an island member ``s`` of ``S`` takes slice ``s`` of ``delta`` ([Note: islands] in
   topology.py; with islands of unequal size ``S`` is the smallest's, and a larger island's members past
   it take none); a plain replica (``S = 1``) takes all of it.
2. reduce-scatter over the ``I`` replicas (or counterparts): the slice is cut into ``I`` pieces,
   piece ``j`` is encoded ([Note: decoding what was sent] in wire.py) and sent to outer rank ``j``;
   each rank decodes the ``I`` copies of its own piece and sums them in rank order, in fp32, and
   divides by ``I`` (the replicas that contributed: fewer inside ``outer.join()``, uneven.py).
3. all-gather over the same group: each rank encodes its averaged piece and sends it to every
   other; every rank (the owner too) decodes all ``I`` pieces.
4. island all-gather: the ``S`` members swap their averaged slices in fp32 over the fast link.

Each piece is summed by exactly one process and then travels as bytes, so the average is the same
bits on every process. Both steps 2 and 3 are one ``all_to_all_single`` of bytes (pieces differ by
at most one value; nothing is padded, so fp32 sends exactly what a ring all-reduce of ``delta``
would: ``2 (I - 1) / I`` of it, per process).

Bytes are counted where they are handed to the collective, as bytes this process *sends* (what is
copied to itself is not on the wire), the convention of hooks/wire.py.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..hooks.wire import all_reduce_bytes
from .error_feedback import Residuals
from .host_state import StagedDelta, ready
from .topology import Topology
from .wire import WireFormat


class Averaged(NamedTuple):
    values: torch.Tensor | None  # the average over the contributors; None: nobody contributed
    active: int  # replicas still in their training loop (all of them outside outer.join())
    residuals: Residuals | None = None  # with error feedback: this process's, to commit when applied


class PendingAverage(Protocol):
    """An exchange in flight: ``result()`` is its average (a ``Future``'s, or one decided when asked for)."""

    def result(self) -> Averaged: ...


class WireCount:
    """What this process put on the wire for the outer exchange."""

    __slots__ = ("sent_bytes", "island_bytes", "exchanges", "peak_in_flight_bytes", "in_flight", "peak_in_flight")

    def __init__(self) -> None:
        self.sent_bytes = 0  # over the slow link: to the other replicas / counterparts
        self.island_bytes = 0  # over the fast link: to the other members of this island
        self.exchanges = 0
        self.peak_in_flight_bytes = 0  # the largest encoded outer gradient one exchange had to move
        self.in_flight = 0  # exchanges started and not yet waited for
        self.peak_in_flight = 0


class OuterExchange:
    """Averages outer gradients across replicas in a wire format; on a thread of its own if asked."""

    def __init__(
        self,
        topology: Topology,
        wire: WireFormat,
        overlap: bool,
        count: WireCount | None = None,
        waiter: Callable[[dist.Work], Any] | None = None,
    ) -> None:
        self.topology = topology
        self.wire = wire
        self.count = count if count is not None else WireCount()
        # With a waiter (the fault-tolerant mode) every collective is issued async and waited for
        # by it, in slices that watch the peers; its work handles are kept in ``works`` until the
        # caller knows the exchange completed (freeing one whose peer died can end the process).
        self.waiter = waiter
        self.works: list[dist.Work] = []
        # One worker: exchanges are issued in the order they start, which is the same on every replica.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gradsync-diloco") if overlap else None

    def start(
        self,
        delta: torch.Tensor | StagedDelta,
        flags: tuple[float, float] | None = None,
        residuals: Residuals | None = None,
    ) -> Future[Averaged]:
        """Begin averaging ``delta`` (flat, the same length everywhere); the future holds the average.
        A ``StagedDelta`` (a GPU run) is waited for where the average is taken: on the thread with ``overlap``.

        ``flags`` = (weight, active) inside ``outer.join()`` ([Note: joining at outer steps] in uneven.py);
        ``residuals``: this process's for the fragment, with error feedback ([Note: error feedback]).
        """
        self.count.in_flight += 1
        self.count.peak_in_flight = max(self.count.peak_in_flight, self.count.in_flight)
        if self._thread is not None:
            return self._thread.submit(self.average, delta, flags, residuals)
        future: Future[Averaged] = Future()
        try:
            future.set_result(self.average(delta, flags, residuals))
        except Exception as error:  # noqa: BLE001 - handed to whoever waits, like the thread's
            future.set_exception(error)
        return future

    def finished(self) -> None:
        self.count.in_flight -= 1

    def average(
        self,
        delta: torch.Tensor | StagedDelta,
        flags: tuple[float, float] | None = None,
        residuals: Residuals | None = None,
        agreed: tuple[int, bool] | None = None,
    ) -> Averaged:
        """``agreed``: (contributors, whether this process's island contributes), decided before the exchange by
        every process alike (gradsync.elastic_diloco's [Note: bad contributions are left out]); one left out sends
        zeros, and the sum is divided by the contributors."""
        delta = ready(delta)  # [Note: the outer state off the GPU], step 2: here, not on the training thread
        t = self.topology
        contributors, active, contributes = float(t.outer_size), t.outer_size, True
        if agreed is not None:
            contributors = float(agreed[0])
            if contributors == 0:
                return Averaged(None, active, residuals)
            if not agreed[1]:
                delta, contributes = torch.zeros_like(delta), False
        if flags is not None:
            counts = torch.tensor(flags, dtype=torch.float32)
            if t.sends_across:
                self._collective(dist.all_reduce, counts, group=t.outer)
                self.count.sent_bytes += all_reduce_bytes(counts, t.outer_size)
            if not t.equal_islands:  # members without counterparts hear the counts from their island's first
                self._collective(dist.broadcast, counts, t.island_source, group=t.island)
                if t.island_rank == 0:
                    self.count.island_bytes += counts.numel() * counts.element_size() * (t.island_size - 1)
            contributors, active = counts[0].item(), int(counts[1].item())
            if contributors == 0:
                return Averaged(None, active, residuals)
            if flags[0] == 0:
                delta, contributes = torch.zeros_like(delta), False
        slices = torch.tensor_split(delta, t.slices)
        if t.sends_across:
            averaged, residuals = self._across(slices[t.island_rank], contributors, residuals, contributes)
        else:  # a larger island's member without counterparts: its mates hand it every slice ([Note: islands])
            averaged = torch.empty(0, dtype=torch.float32)
        self.count.exchanges += 1
        if t.island_size == 1:
            return Averaged(averaged, active, residuals)
        sizes = [s.numel() * 4 for s in slices] + [0] * (t.island_size - t.slices)
        gathered = self._all_to_all(t.within()[0], averaged.view(torch.uint8), sizes, island=True)
        return Averaged(gathered.view(torch.float32), active, residuals)

    def _across(
        self, values: torch.Tensor, contributors: float, residuals: Residuals | None, contributes: bool
    ) -> tuple[torch.Tensor, Residuals | None]:
        t, wire = self.topology, self.wire
        if t.outer_size == 1:  # nothing travels, nothing is rounded
            return values.to(torch.float32).clone(), residuals
        if residuals is not None and contributes:
            values = values.to(torch.float32) + residuals.sent
        pieces = torch.tensor_split(values, t.outer_size)
        sizes = [wire.encoded_nbytes(p.numel()) for p in pieces]
        mine = pieces[t.outer_rank].numel()
        parts = [wire.encode(p) for p in pieces]
        encoded = torch.cat(parts)
        self.count.peak_in_flight_bytes = max(self.count.peak_in_flight_bytes, encoded.numel())
        received = torch.empty(sizes[t.outer_rank] * t.outer_size, dtype=torch.uint8)
        self._collective(
            dist.all_to_all_single, received, encoded, [sizes[t.outer_rank]] * t.outer_size, sizes, group=t.outer
        )
        self.count.sent_bytes += sum(sizes) - sizes[t.outer_rank]
        total = None
        for part in received.split(sizes[t.outer_rank]):  # in rank order: the same sum wherever it is taken
            decoded = wire.decode(part, mine)
            total = decoded if total is None else total.add_(decoded)
        assert total is not None
        mean = total.div_(contributors)
        start = sum(p.numel() for p in pieces[: t.outer_rank])  # where this process's piece begins
        if residuals is not None:
            mean.add_(residuals.owned[start : start + mine])
        own = wire.encode(mean)
        if residuals is not None:
            residuals = self._new_residuals(residuals, values, pieces, parts, mean, own, start, contributes)
        gathered = self._all_to_all(t.across()[0], own, sizes, island=False)
        return torch.cat([wire.decode(part, p.numel()) for part, p in zip(gathered.split(sizes), pieces)]), residuals

    def _new_residuals(
        self,
        old: Residuals,
        values: torch.Tensor,
        pieces: tuple[torch.Tensor, ...],
        parts: list[torch.Tensor],
        mean: torch.Tensor,
        own: torch.Tensor,
        start: int,
        contributes: bool,
    ) -> Residuals:
        """What this exchange's rounding removed, from what was compensated ([Note: error feedback])."""
        wire = self.wire
        sent = old.sent
        if contributes:  # decode is a fixed function of the bytes: this is what the owners summed
            sent = values - torch.cat([wire.decode(part, p.numel()) for part, p in zip(parts, pieces)])
        owned = torch.zeros_like(old.owned)
        owned[start : start + mean.numel()] = mean - wire.decode(own, mean.numel())
        return Residuals(sent, owned)

    def _all_to_all(self, group: dist.ProcessGroup, own: torch.Tensor, sizes: list[int], island: bool) -> torch.Tensor:
        """All-gather of byte pieces of unequal sizes (``sizes[j]`` from rank ``j``) as one all-to-all."""
        rank, world = dist.get_rank(group), len(sizes)
        received = torch.empty(sum(sizes), dtype=torch.uint8)
        self._collective(dist.all_to_all_single, received, own.repeat(world), sizes, [own.numel()] * world, group=group)
        sent = own.numel() * (world - 1)
        if island:
            self.count.island_bytes += sent
        else:
            self.count.sent_bytes += sent
        assert own.numel() == sizes[rank], "every rank must encode its own piece to the size the others expect"
        return received

    def collective(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``collective`` as the exchange runs its own (waited for by the waiter, its work handle kept)."""
        self._collective(collective, *args, **kwargs)

    def _collective(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self.waiter is None:
            collective(*args, **kwargs)
            return
        work = collective(*args, async_op=True, **kwargs)
        self.works.append(work)
        self.waiter(work)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
