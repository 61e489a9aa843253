"""What each synced iteration did, kept for ``ddp.stats()``, torch's logging data and ``gradsync.trace``."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from ..observability.cuda_clock import CudaClock
from ..observability.stats import BucketInfo, DDPStats
from ..observability.timing import IterationTimes, RunningStats, now
from ..observability.trace import Timeline
from . import errors
from .backward_pass import BackwardPass
from .bucket_set import BucketSet
from .config import ReducerConfig


class Records:
    """Running sums, the timeline while tracing, whether the graph stayed static, the last error."""

    def __init__(self, num_buckets: int, clock: CudaClock | None = None) -> None:
        self.running = RunningStats()
        self.running.new_layout(num_buckets)
        self._timeline: Timeline | None = None  # set by gradsync.trace for the duration of its block
        # CUDA: the events an iteration's figures are read from, later ([Note: CUDA-event timings]); None on CPU.
        self.clock = clock
        # torch's can_set_static_graph: the same parameters unused in every synced iteration so far.
        self.graph_static = True
        self.last_error: str | None = None  # torch's logging data reports it as "error"
        self._last_unused: tuple[int, ...] | None = None
        self._warned_nothing_unused = False

    def record(
        self, iteration: int, current: BackwardPass, buckets: BucketSet, names: list[str], rank: int, warn: bool
    ) -> None:
        """End of a synced backward. ``warn``: find_unused_parameters is on (and the graph not static)."""
        times = current.times
        times.finalize_end = now()
        unused_indices = tuple(sorted(current.marked_unused))
        if self._last_unused is not None and unused_indices != self._last_unused:
            self.graph_static = False
        self._last_unused = unused_indices
        unused = tuple(names[i] for i in unused_indices)
        # Bucket sizes only while tracing: summing every parameter's bytes per iteration is not free.
        nbytes, sizes = buckets.nbytes, None if self._timeline is None else [s.nbytes for s in buckets.storages]
        if self.clock is None:
            self._add(iteration, times, nbytes, sizes, unused)
        else:  # once the GPU has run it ([Note: CUDA-event timings] in observability/cuda_clock.py)
            self.clock.finished(times, lambda resolved: self._add(iteration, resolved, nbytes, sizes, unused))
        if warn and not unused and not self._warned_nothing_unused:
            self._warned_nothing_unused = True
            warnings.warn(errors.nothing_unused(rank, iteration), UserWarning, stacklevel=2)

    def _add(
        self, iteration: int, times: IterationTimes, nbytes: int, sizes: list[int] | None, unused: tuple[str, ...]
    ) -> None:
        self.running.add(times, nbytes, unused)
        if self._timeline is not None and sizes is not None:
            self._timeline.add_iteration(iteration, times, sizes)

    @property
    def timeline(self) -> Timeline | None:
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        """Start or stop tracing; on CUDA a trace that ends first takes in the iterations still on the GPU."""
        if timeline is None and self.clock is not None:
            self.clock.collect(wait=True)
        if self.clock is not None:  # a timeline draws every bucket's completion on every pass
            self.clock.every_bucket_always = timeline is not None
        self._timeline = timeline

    def collect(self) -> None:
        """On CUDA: take in every finished iteration whose events have run (no waiting)."""
        if self.clock is not None:
            self.clock.collect()

    def watch_completion(self, times: IterationTimes, b: int, pending: Any) -> None:
        """While tracing: note when bucket ``b``'s reduction completes, not only when it is waited for."""
        future = pending.get_future() if isinstance(pending, dist.Work) else pending

        def done(_: Any) -> None:
            times.bucket_done[b] = now()

        future.add_done_callback(done)


def collect_stats(
    records: Records,
    buckets: BucketSet,
    names: list[str],
    config: ReducerConfig,
    rank: int,
    world_size: int,
    rebuilt: bool,
    hook_name: str | None,
) -> DDPStats:
    records.collect()
    running = records.running
    launches = running.bucket_launches
    infos = tuple(
        BucketInfo(
            index=b,
            numel=sum(p.numel() for p in storage.params),
            nbytes=storage.nbytes,
            dtype=str(storage.params[0].dtype),
            parameter_names=tuple(names[i] for i in storage.param_indices),
            sparse=storage.sparse,
            launches=launches[b] if b < len(launches) else 0,
            avg_reduce_s=running.average_reduce_s(b),
            timed=running.bucket_timed[b] if b < len(running.bucket_timed) else 0,
        )
        for b, storage in enumerate(buckets.storages)
    )
    return DDPStats(
        rank=rank,
        world_size=world_size,
        buckets=infos,
        buckets_rebuilt=rebuilt,
        iterations=running.iterations,
        avg_forward_s=running.average(running.forward_s),
        avg_backward_s=running.average(running.backward_s),
        avg_comm_s=running.average(running.comm_s),
        avg_exposed_comm_s=running.average(running.exposed_comm_s),
        avg_buffer_sync_s=running.average(running.buffer_sync_s),
        bytes_reduced_per_iteration=buckets.nbytes,
        total_bytes_reduced=running.total_bytes,
        unused_parameters=running.last_unused,
        comm_hook=hook_name,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        timing="host clock" if records.clock is None else "CUDA events",
    )
