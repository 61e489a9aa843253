"""Timings that are true on a GPU: CUDA events for the per-iteration and per-bucket figures.

[Note: CUDA-event timings]
On CUDA a host clock measures when work was *queued*: ``all_reduce(async_op=True)`` and
``work.wait()`` return at once (NCCL's ``wait()`` only makes the current stream wait), so host
timestamps put communication at about zero and backward at the time it took to launch its kernels.
So on CUDA the engine records events where it takes timestamps on CPU (timing.py's
``IterationTimes``):

- forward start and end, backward start (the first gradient hook), each bucket's launch and the end
  of backward (finalize start and end), on the stream current there;
- a bucket's completion from a done-callback on its work's future: torch runs such callbacks with
  the current stream set to one that waited for the collective (``torch.futures.Future.then``'s
  contract for CUDA futures), so the event lands exactly where the reduction ended, not where the
  caller's stream next looked.

[Note: sampled bucket completions]
A Python callback on an NCCL work's future is not free: measured on an H200 (GPT-2 small, batch
8 x 1024, 14 buckets; benchmarks/results/2026-12-04-gpu-host-profile.md), one per bucket made the step
1.020x torch's DDP where the same reducer without them ran at 0.985x (likely: the callback's owner is
released later on a C++ thread that must take the GIL from the training loop). With the sampling below
it runs at 0.985-0.986x, as with no event at all. So the completion is watched on
every pass for the *last* bucket only (collectives of one group run in launch order on one stream, so
its completion is when every reduction ended: the communication window and the exposed communication
stay exact on every pass), and for every bucket on the first ``FULL_PASSES_FIRST`` timed passes, then
one in ``FULL_PASS_EVERY`` (and on every pass while a timeline is traced, which watches every bucket
on the host anyway). A bucket's average reduce time in ``stats()`` is over the passes that timed it
(``timed`` of them); its ``launches`` count every completed reduction. torch's DDP samples its runtime statistics too,
one iteration in 100 (``kDDPRuntimeLoggingSampleRate``).

Events are read without stalling the next iteration: a finished backward's events are kept until
``query()`` says every one of them has run, then turned into an ``IterationTimes`` on the host
clock's axis (one anchor event synchronised once, at construction) and handed on to the running
sums and the timeline. Only when the host runs more than ``MAX_PENDING`` backwards ahead of the GPU
does it wait for the oldest (the GPU is then the bottleneck: waiting costs no throughput).
``ddp.stats()`` therefore counts the iterations whose GPU work has finished; after
``torch.cuda.synchronize()`` that is all of them.

Left on the host clock: the buffer broadcast before forward (queued time) and when a bucket became
ready (zeroed on CUDA, so the timeline draws no wait before a launch). Under CUDA-graph capture
nothing is recorded: a captured pass keeps its host times.

torch's reducer does the same with five events per iteration (``reducer_cuda.cpp``'s ``CudaTimer``),
read at the next forward; gradsync adds one per bucket launch and one per watched completion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradsync.cuda.current_stream import CurrentStream

from .timing import IterationTimes, now

MAX_PENDING = 8  # finished backwards whose events may be outstanding before the oldest is waited for
FULL_PASSES_FIRST = 8  # timed passes that watch every bucket's completion before sampling starts
FULL_PASS_EVERY = 32  # after those, one timed pass in this many watches every bucket ([Note: sampled ...])


class PassEvents:
    """The events of one synced backward (None where nothing was recorded)."""

    __slots__ = (
        "forward_start",
        "forward_end",
        "backward_start",
        "finalize_start",
        "finalize_end",
        "bucket_launch",
        "bucket_done",
        "watched",
        "untimed",
        "every_bucket",
    )

    def __init__(self, num_buckets: int, forward: tuple[Any, Any], every_bucket: bool = True) -> None:
        self.forward_start, self.forward_end = forward
        self.backward_start: Any = None
        self.finalize_start: Any = None
        self.finalize_end: Any = None
        self.bucket_launch: list[Any] = [None] * num_buckets
        self.bucket_done: list[Any] = [None] * num_buckets  # set by the completion callback
        self.watched: list[int] = []  # buckets whose completion callback was registered
        self.untimed: list[int] = []  # buckets reduced whose completion this pass does not time
        self.every_bucket = every_bucket  # False: only the last bucket's completion is timed

    def recorded(self) -> list[Any]:
        fixed = [self.forward_start, self.forward_end, self.backward_start, self.finalize_start, self.finalize_end]
        return [e for e in (*fixed, *self.bucket_launch, *self.bucket_done) if e is not None]

    def complete(self) -> bool:
        """Every watched bucket reported, and every recorded event has run on the GPU."""
        if any(self.bucket_done[b] is None for b in self.watched):
            return False
        return all(event.query() for event in self.recorded())


class CudaClock:
    """Records one synced backward's events and resolves finished ones into ``IterationTimes``.

    ``new_event``, ``current_stream`` and ``capturing`` are torch.cuda's unless a test passes fakes.
    """

    def __init__(
        self,
        device: torch.device,
        new_event: Callable[[], Any] | None = None,
        current_stream: Callable[[torch.device], Any] | None = None,
        capturing: Callable[[], bool] | None = None,
    ) -> None:
        self.device = device
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._current = CurrentStream(device, current_stream)
        self._capturing = capturing or torch.cuda.is_current_stream_capturing
        self._free: list[Any] = []  # events of resolved passes, reused
        self._timed_passes = 0  # passes begun with events, for [Note: sampled bucket completions]
        self.every_bucket_always = False  # set while a timeline is traced: every completion timed
        self._forward: list[Any] = [None, None]  # the next pass's forward start and end
        self.current: PassEvents | None = None  # None: this pass is not timed (captured, or not begun)
        self._pending: deque[tuple[PassEvents, IterationTimes, Callable[[IterationTimes], None]]] = deque()
        # The anchor: host time of one event known to have run, so events map onto perf_counter seconds.
        self._anchor = self._new_event()
        self._anchor.record(self._current.stream())
        self._anchor.synchronize()
        self._anchor_s = now()

    # ------------------------------------------------------------------ recording
    def _mark(self) -> Any:
        event = self._free.pop() if self._free else self._new_event()
        event.record(self._current.stream())
        return event

    def forward_started(self) -> None:
        self._forward = [None if self._capturing() else self._mark(), None]

    def forward_ended(self) -> None:
        if self._forward[0] is not None:
            self._forward[1] = self._mark()

    def begin_pass(self, num_buckets: int) -> None:
        forward = (self._forward[0], self._forward[1]) if self._forward[1] is not None else (None, None)
        self._forward = [None, None]
        if self._capturing():
            self.current = None
            return
        n = self._timed_passes
        self._timed_passes += 1
        every_bucket = self.every_bucket_always or n < FULL_PASSES_FIRST or n % FULL_PASS_EVERY == 0
        self.current = PassEvents(num_buckets, forward, every_bucket)

    def backward_started(self) -> None:
        if self.current is not None:
            self.current.backward_start = self._mark()

    def launched(self, b: int) -> None:
        """Bucket ``b`` is about to be copied in and started on the current stream."""
        if self.current is not None:
            self.current.bucket_launch[b] = self._mark()

    def watch(self, b: int, pending: Any) -> None:
        """Record bucket ``b``'s completion from its work's (or comm hook's) future, where this pass times
        it ([Note: sampled bucket completions]): the last bucket always, the others on sampled passes."""
        events = self.current
        future = None if events is None else _future_of(pending)
        if events is None or future is None:
            return  # untimed pass, nothing started, or a reduction that exposes no future: no completion event
        if not events.every_bucket and b != len(events.bucket_done) - 1:
            events.untimed.append(b)
            return
        event = self._free.pop() if self._free else self._new_event()
        current = self._current

        def done(_: Any) -> None:
            event.record(current.stream())  # on the stream torch synchronised with the collective
            events.bucket_done[b] = event

        events.watched.append(b)
        future.add_done_callback(done)

    def finalize_started(self) -> None:
        if self.current is not None:
            self.current.finalize_start = self._mark()

    def finished(self, times: IterationTimes, deliver: Callable[[IterationTimes], None]) -> None:
        """The backward ended: ``deliver(times)`` once its events are read (at once when untimed)."""
        events, self.current = self.current, None
        if events is None or events.backward_start is None:
            deliver(times)
            return
        events.finalize_end = self._mark()
        self._pending.append((events, times, deliver))
        self.collect()

    # ------------------------------------------------------------------ reading
    @property
    def pending(self) -> int:
        """Finished backwards whose events have not been read yet."""
        return len(self._pending)

    def collect(self, wait: bool = False) -> None:
        """Deliver every finished backward whose events have run; ``wait``: all of them, waiting if needed."""
        while self._pending:
            events, times, deliver = self._pending[0]
            if not events.complete():
                if not wait and len(self._pending) <= MAX_PENDING:
                    return
                for event in events.recorded():
                    event.synchronize()
            self._pending.popleft()
            self._resolve(events, times)
            deliver(times)

    def _seconds(self, event: Any) -> float:
        seconds: float = self._anchor_s + self._anchor.elapsed_time(event) / 1e3
        return seconds

    def _resolve(self, events: PassEvents, times: IterationTimes) -> None:
        """Overwrite ``times``' host timestamps with the events' (perf_counter axis)."""
        seconds = self._seconds
        if events.forward_start is not None and events.forward_end is not None:
            times.forward_start, times.forward_end = seconds(events.forward_start), seconds(events.forward_end)
        times.backward_start = seconds(events.backward_start)
        start = events.finalize_start
        times.finalize_start = seconds(start) if start is not None else times.backward_start
        times.finalize_end = seconds(events.finalize_end)
        done_times = []
        times.bucket_untimed = events.untimed
        for b, (launch, done) in enumerate(zip(events.bucket_launch, events.bucket_done)):
            times.bucket_ready[b] = 0.0
            times.bucket_launch[b] = seconds(launch) if launch is not None else 0.0
            times.bucket_done[b] = seconds(done) if launch is not None and done is not None else 0.0
            if times.bucket_done[b]:
                done_times.append(times.bucket_done[b])
        times.reductions_done = max(done_times, default=times.finalize_start)
        # Reused from now on. A completion that reports after a forced read (a failed collective) records
        # into its own event, which ``recorded()`` did not list: it is dropped, never reused.
        self._free.extend(events.recorded())


def _future_of(pending: Any) -> Any:
    """The future that completes with a bucket's reduction: a work's, a comm hook's, or that of the work a
    pending reduce-scatter carries (``.work``, collectives/sharded.py); None when there is none."""
    if pending is None:
        return None
    if isinstance(pending, dist.Work):
        return pending.get_future()
    if callable(getattr(pending, "add_done_callback", None)):
        return pending
    work = getattr(pending, "work", None)
    return work.get_future() if isinstance(work, dist.Work) else None


def cuda_clock_for(device: torch.device) -> CudaClock | None:
    """A ``CudaClock`` for a reducer whose buckets are on a CUDA ``device``; None elsewhere (host clocks)."""
    return CudaClock(device) if device.type == "cuda" else None
