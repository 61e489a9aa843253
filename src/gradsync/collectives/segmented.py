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

So on CPU (gloo) the reduce-scatter, and at two ranks the all-gather, are ``isend``/``irecv``
pairs, a segment to and from every peer at a time, issued by a thread of the process group's own
(``Exchanger``): the next segment must go out as the one before arrives while backward computes,
and one thread per group keeps the exchanges in the order they were started, which every rank
shares (point-to-point messages between two ranks are matched in the order they were sent). The
thread waits in C++ without the GIL. Above two ranks gloo's ring all-gather, which sends each
step's chunk to one neighbour, measured faster in training than this exchange with every peer
(step 121 vs 142 ms at 4 ranks, 4 processes on 2 cores), so it stays; the reduce-scatter measured
94-96 ms against ``all_to_all_single``'s 112-139 ms alone, the same in training.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

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

    def wait(self, timeout: Any = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def done(self) -> bool:
        return self._done.is_set()

    is_completed = done

    def _finish(self, error: BaseException | None, keep: list[Any]) -> None:
        self._error = error
        if error is None:
            self._tensors = ()
        else:  # a failed exchange may still be written into: its buffers and handles stay alive
            self._tensors = (*self._tensors, keep)
        self._done.set()


class _Job:
    """One exchange: to ``send_to[i]`` goes ``sends[i]``, from ``receive_from[i]`` comes ``receives[i]``."""

    __slots__ = ("group", "send_to", "sends", "receive_from", "receives", "local", "exchange")

    def __init__(
        self, group: Any, send_to: list[int], sends: list[Any], receive_from: list[int], receives: list[Any], local: Any
    ) -> None:
        self.group, self.local = group, local
        self.send_to, self.sends = send_to, sends
        self.receive_from, self.receives = receive_from, receives
        self.exchange = Exchange((sends, receives, local))


class Exchanger:
    """One process group's exchanges, issued in the order they were started by a thread of its own."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self._group = weakref.ref(group)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        thread = threading.Thread(target=_run, args=(self._jobs,), name="gradsync-exchange", daemon=True)
        thread.start()
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
        group = self._group()
        if group is None:
            raise RuntimeError("An exchange was started on a process group that no longer exists.")
        # Step i sends to the rank i after this one and receives from the rank i before it: every
        # rank sends to a different one at a time instead of all of them to rank 0 first.
        n, r = self.world_size, self.rank
        send_to = [(r + i) % n for i in range(1, n)]
        receive_from = [(r - i) % n for i in range(1, n)]
        job = _Job(
            group,
            [self._global[j] for j in send_to],
            [sends[j] for j in send_to],
            [self._global[j] for j in receive_from],
            [receives[j] for j in receive_from],
            local,
        )
        self._jobs.put(job)
        return job.exchange


def _run(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        handles: list[Any] = []
        try:
            _exchange(job, handles)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the exchange
            job.exchange._finish(error, handles)
        else:
            job.exchange._finish(None, handles)
        del job, handles


def _exchange(job: _Job, handles: list[Any]) -> None:
    if job.local is not None:
        job.local[0].copy_(job.local[1])
    peers = len(job.sends)
    if peers == 0:
        return
    length = job.sends[0].numel()
    step = max(1, SEGMENT_BYTES // job.sends[0].element_size())
    in_flight: list[list[Any]] = []
    for start in range(0, length, step):
        stop = min(length, start + step)
        segment = []
        for i in range(peers):
            segment.append(dist.isend(job.sends[i][start:stop], job.send_to[i], group=job.group))
            segment.append(dist.irecv(job.receives[i][start:stop], job.receive_from[i], group=job.group))
        handles.extend(segment)
        in_flight.append(segment)
        if len(in_flight) > WINDOW:
            for work in in_flight.pop(0):
                work.wait()
    for segment in in_flight:
        for work in segment:
            work.wait()


_EXCHANGERS: weakref.WeakKeyDictionary[Any, Exchanger] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def exchanger(group: dist.ProcessGroup | None) -> Exchanger:
    """The exchanger of ``group`` (None: the default group), made on first use."""
    group = group if group is not None else dist.group.WORLD
    with _LOCK:
        found = _EXCHANGERS.get(group)
        if found is None:
            found = _EXCHANGERS[group] = Exchanger(group)
        return found
