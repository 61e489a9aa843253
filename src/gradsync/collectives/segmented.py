"""Exchanges between every pair of ranks, sent in segments by one thread per process group.

[Note: exchanges in segments]
A reduce-scatter or all-gather sends a chunk to each peer while it receives one from each: both
directions of every link carry data at once. Sent as one large message per peer (gloo's
``all_to_all_single``, and its all-gather at two ranks), each direction's acknowledgements queue
behind the other direction's data wherever the link has a standing queue, and the exchange runs at
about half the link's rate. Measured on one shaped 1 Gbit/s link per rank, 2 ranks, 14 MiB
buckets: 7 MiB one way 45 ms, 7 MiB each way at once 102 ms; ``all_to_all_single`` 103-119 ms, the
all-gather 77-93 ms, so reduce-scatter plus all-gather took 209 ms where gloo's all-reduce (the same
bytes, in lockstep chunks) takes 120. Sent in 256 KiB segments with at most two of them per peer
on the wire, the reduce-scatter takes 62 ms and the all-gather 60 ms: 122 ms together.

So on CPU (gloo) the reduce-scatter and the all-gather are ``isend``/``irecv`` pairs, a segment
to and from every peer at a time, issued by a thread of the process group's own (``Exchanger``):
the next segment must go out as the one before arrives while backward computes, and one thread
per group keeps the exchanges in the order they were started, which every rank shares
(point-to-point messages between two ranks are matched in the order they were sent). The thread
waits in C++ without the GIL. The reduce-scatter measured 94-96 ms against ``all_to_all_single``'s
112-139 ms alone, the same in training. Above two ranks gloo's ring all-gather, which sends each
step's chunk to one neighbour, measured faster when a step waited for its gathers (step 121 vs 142
ms at 4 ranks, 4 processes on 2 cores); but it allocates a temporary as large as its output, one
per gather running, and the step's gathers overlap the next forward: all started at once, they
held 1.06x stage 2's memory target at 3-4 ranks, where the exchange (received in place) holds
1.004-1.006x, and overlapped it trained at 0.994 [0.965, 1.038] of gradsync DDP at 4 ranks against
the ring's 1.033 [0.995, 1.083] (2026-12-02-zero-*-peers.md). So the exchange is the all-gather at
every size.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

SEGMENT_BYTES = 256 * 1024  # what one message carries: small enough that no queue builds up
WINDOW = 2  # segments per peer sent and not yet received: one arriving while the next is sent


class Exchange:
    """An exchange in flight: ``wait`` returns once every segment arrived (or raises its failure)."""

    __slots__ = ("_done", "_error", "_tensors", "__weakref__")

    def __init__(self, tensors: tuple[Any, ...]) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._tensors: tuple[Any, ...] = tensors  # alive until every segment was sent and received

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Until every segment arrived (each segment's wait is bounded by the group's timeout), or for
        ``timeout`` at most: then a ``RuntimeError`` saying it timed out, as a work handle's would."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"Timed out after {timeout} waiting for a gradsync exchange to complete.")
        if self._error is not None:
            raise self._error
        return True

    def done(self) -> bool:
        return self._done.is_set()

    is_completed = done

    def _finish(self, error: BaseException | None, keep: list[Any] | None) -> None:
        self._error = error
        if error is None:
            self._tensors = ()
        else:  # a failed exchange may still be written into: its buffers and handles stay alive
            self._tensors = (*self._tensors, keep)
        self._done.set()


def fold(pieces: Sequence[torch.Tensor], target: torch.Tensor, accumulate: bool) -> None:
    """``target`` becomes (``accumulate``: gets added) ``pieces[0] + pieces[1] + ...``, left to right.

    Every rank's chunk in rank order: the same bits whatever the bucket layout or the segments."""
    rest = pieces[1:]
    if accumulate:
        target.add_(pieces[0])
    elif rest and pieces[0].dtype == rest[0].dtype == target.dtype:
        # One kernel for the first sum instead of a copy and an add: the same a + b. (In a lower precision
        # on the wire the pieces are widened first: their sum must not be rounded to it.)
        torch.add(pieces[0], rest[0], out=target)
        rest = rest[1:]
    else:
        target.copy_(pieces[0])
    for piece in rest:
        target.add_(piece)


class _Job:
    """One exchange of equally long 1-D tensors, ``sends[i]`` to group rank ``send_to[i]`` while
    ``receive_from[i]``'s segments arrive (in ``receives[i]``, or summed on arrival by ``_ReduceScatter``)."""

    def __init__(self, group: Any, peers: _Peers, sends: list[Any], length: int, keep: tuple[Any, ...]) -> None:
        # Segments go through the group's own send and recv (group ranks), which dist.isend and dist.irecv
        # call after checks that cost about as much as the call and hold for every segment alike.
        self.group, self.send_to, self.receive_from = group, peers.send_order, peers.receive_order
        self.sends, self.length = sends, length
        self.step = max(1, SEGMENT_BYTES // sends[0].element_size()) if sends else 1  # elements per segment
        self.exchange = Exchange(keep)

    def run(self, handles: list[Any]) -> None:
        if not self.sends:
            return
        in_flight: collections.deque[tuple[int, int, int, list[Any]]] = collections.deque()
        send, receive = self.group.send, self.group.recv
        wire = torch.view_as_real if self.sends[0].is_complex() else _same  # as dist.isend sends complex tensors
        for k, start in enumerate(range(0, self.length, self.step)):
            stop = min(self.length, start + self.step)
            works = [send([wire(t[start:stop])], dst, 0) for t, dst in zip(self.sends, self.send_to)]
            works += [
                receive([wire(self.receive_into(i, k, start, stop))], src, 0) for i, src in enumerate(self.receive_from)
            ]
            handles.extend(works)
            in_flight.append((k, start, stop, works))
            if len(in_flight) > WINDOW:
                self.arrived(*in_flight.popleft())
        while in_flight:
            self.arrived(*in_flight.popleft())

    def receive_into(self, i: int, k: int, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def arrived(self, k: int, start: int, stop: int, works: list[Any]) -> None:
        for work in works:
            work.wait()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Gather(_Job):
    """Every peer's segments land in place, in ``receives[i]``."""

    def __init__(self, group: Any, peers: _Peers, sends: list[Any], receives: list[Any],
                 local: tuple[torch.Tensor, torch.Tensor] | None) -> None:  # fmt: skip
        super().__init__(group, peers, sends, sends[0].numel() if sends else 0, (sends, receives, local))
        self.receives, self.local = receives, local

    def run(self, handles: list[Any]) -> None:
        if self.local is not None:
            self.local[0].copy_(self.local[1])
        super().run(handles)

    def receive_into(self, i: int, k: int, start: int, stop: int) -> torch.Tensor:
        into: torch.Tensor = self.receives[i][start:stop]
        return into


class _ReduceScatter(_Job):
    """[Note: a reduce-scatter summed as it arrives]
    Each peer's segment lands in a small ring of ``WINDOW + 1`` slots (a slot is reused once the
    segment in it was summed: at most ``WINDOW`` are in flight), and as soon as every peer's
    segment ``k`` arrived, ``fold`` sums the ``N`` pieces of it into ``target`` in rank order. So no
    receive buffer as large as the bucket exists (ZeRO-2 holds one bucket less, ZeRO-1's memory
    is its formula's), and the sum runs on this thread while backward goes on.
    """

    def __init__(self, group: Any, peers: _Peers, chunks: list[torch.Tensor], rank: int, target: torch.Tensor,
                 accumulate: bool, scratch: dict[Any, torch.Tensor]) -> None:  # fmt: skip
        super().__init__(group, peers, [chunks[j] for j in peers.send_order], target.numel(), (chunks, target))
        self.chunks, self.rank, self.target, self.accumulate = chunks, rank, target, accumulate
        self.scratch = scratch  # the exchanger's, reused: its jobs run one after the other
        self.slots: list[torch.Tensor] = []
        self.own: torch.Tensor | None = None  # this rank's segment, when it is also where the sum goes (ZeRO-1)

    def run(self, handles: list[Any]) -> None:
        n, dtype = len(self.chunks), self.chunks[0].dtype
        if n == 1:
            fold(self.chunks, self.target, self.accumulate)
            return
        key = (dtype, self.target.device, n, self.step)
        rows = self.scratch.get(key)
        if rows is None:  # per peer a ring of segments, and a row for this rank's own
            rows = self.scratch[key] = torch.empty(n, (WINDOW + 1) * self.step, dtype=dtype, device=self.target.device)
        self.slots = list(rows[: n - 1])
        if self.chunks[self.rank].data_ptr() == self.target.data_ptr():
            self.own = rows[n - 1]
        try:
            super().run(handles)
        except BaseException:
            self.scratch.pop(key, None)  # segments of the failed exchange may still arrive in it
            raise

    def receive_into(self, i: int, k: int, start: int, stop: int) -> torch.Tensor:
        at = (k % (WINDOW + 1)) * self.step
        return self.slots[i].narrow(0, at, stop - start)

    def arrived(self, k: int, start: int, stop: int, works: list[Any]) -> None:
        super().arrived(k, start, stop, works)
        n, size = len(self.chunks), stop - start
        pieces: list[torch.Tensor] = []
        for j in range(n):  # rank order: the peer j ranks before this one is receive_from[j - 1] counted back
            if j == self.rank:
                own = self.chunks[j][start:stop]
                pieces.append(own if self.own is None else self.own[:size].copy_(own))
            else:
                pieces.append(self.receive_into((self.rank - j) % n - 1, k, start, stop))
        fold(pieces, self.target[start:stop], self.accumulate)


class _Peers(NamedTuple):
    """Who a rank exchanges with, step by step, in group ranks: step ``i`` sends to the rank ``i`` after it
    and receives from the rank ``i`` before it, so every rank sends to a different one at a time instead
    of all of them to rank 0 first."""

    send_order: list[int]
    receive_order: list[int]

    @staticmethod
    def of(group: dist.ProcessGroup) -> _Peers:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return _Peers([(r + i) % n for i in range(1, n)], [(r - i) % n for i in range(1, n)])


class Exchanger:
    """One process group's exchanges, issued in the order they were started by a thread of its own."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._peers = _Peers.of(group)
        self._group = weakref.ref(group)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._scratch: dict[Any, torch.Tensor] = {}  # where reduce-scatters receive, reused (only its thread uses it)
        self._thread = threading.Thread(target=_run, args=(self._jobs,), name="gradsync-exchange", daemon=True)
        self._thread.start()
        weakref.finalize(group, self._jobs.put, None)  # the group is gone: so is its thread

    def start(
        self,
        sends: Sequence[torch.Tensor | None],
        receives: Sequence[torch.Tensor | None],
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Exchange:
        """Send ``sends[j]`` to group rank ``j`` and receive ``receives[j]`` from it, for every other rank.

        All of them 1-D, contiguous and equally long; ``local = (destination, source)``: a copy
        made first, on the thread (this rank's own chunk)."""
        peers = self._peers
        sent, received = [sends[j] for j in peers.send_order], [receives[j] for j in peers.receive_order]
        return self._put(_Gather(self._live_group(), peers, sent, received, local))

    def reduce_scatter(self, chunks: Sequence[torch.Tensor], target: torch.Tensor, accumulate: bool) -> Exchange:
        """Send ``chunks[j]`` to group rank ``j``; ``target`` becomes (``accumulate``: gets added) the sum of
        every rank's chunk for this rank, in rank order ([Note: a reduce-scatter summed as it arrives])."""
        group, chunks = self._live_group(), list(chunks)
        return self._put(_ReduceScatter(group, self._peers, chunks, self.rank, target, accumulate, self._scratch))

    def _live_group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("An exchange was started on a process group that no longer exists.")
        return group

    def _put(self, job: _Job) -> Exchange:
        self._jobs.put(job)
        return job.exchange

    def close(self, timeout_s: float) -> None:
        """Let the thread finish the exchanges started and stop (waiting ``timeout_s`` at most)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)


def _run(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        handles: list[Any] = []
        error: BaseException | None = None
        try:
            job.run(handles)
        except BaseException as failure:  # noqa: BLE001 - handed to whoever waits for the exchange
            error = failure
        exchange, kept = job.exchange, (handles if error is not None else None)
        # Let go of the job's tensors before the waiter wakes: a bucket it frees must not stay alive here.
        del job, handles
        exchange._finish(error, kept)
        del exchange, kept, error


_EXCHANGERS: weakref.WeakKeyDictionary[Any, Exchanger] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


# How long the interpreter's exit waits for exchanges still in flight (a peer that died makes each segment
# wait for the group's timeout, which can be half an hour).
EXIT_WAIT_S = 60.0


@atexit.register
def _close_at_exit() -> None:
    """A program may end with exchanges in flight (a sharded optimizer's all-gathers overlap the next forward,
    and the last step has none). Their thread is a daemon, and a daemon thread still waiting in C++ when
    the interpreter finalizes aborts the process (``terminate called without an active exception``): so at
    exit each exchanger finishes what was started and its thread stops first."""
    with _LOCK:
        exchangers = list(_EXCHANGERS.values())
    for found in exchangers:
        found.close(EXIT_WAIT_S)


def exchanger(group: dist.ProcessGroup | None) -> Exchanger:
    """The exchanger of ``group`` (None: the default group), made on first use."""
    group = group if group is not None else cast(dist.ProcessGroup, dist.group.WORLD)
    with _LOCK:
        found = _EXCHANGERS.get(group)
        if found is None:
            found = _EXCHANGERS[group] = Exchanger(group)
        return found
