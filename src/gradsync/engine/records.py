"""What each synced iteration did, kept for ``ddp.stats()``, torch's logging data and ``gradsync.trace``."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from ..observability.stats import BucketInfo, DDPStats
from ..observability.timing import IterationTimes, RunningStats, now
from ..observability.trace import Timeline
from . import errors
from .backward_pass import BackwardPass
from .bucket_set import BucketSet
from .config import ReducerConfig


class Records:
    """Running sums, the timeline while tracing, whether the graph stayed static, the last error."""

    def __init__(self, num_buckets: int) -> None:
        self.running = RunningStats()
        self.running.new_layout(num_buckets)
        self.timeline: Timeline | None = None  # set by gradsync.trace for the duration of its block
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
        self.running.add(times, buckets.nbytes, unused)
        if self.timeline is not None:
            self.timeline.add_iteration(iteration, times, [s.nbytes for s in buckets.storages])
        if warn and not unused and not self._warned_nothing_unused:
            self._warned_nothing_unused = True
            warnings.warn(errors.nothing_unused(rank, iteration), UserWarning, stacklevel=2)

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
    running = records.running
    launches, seconds = running.bucket_launches, running.bucket_s
    infos = tuple(
        BucketInfo(
            index=b,
            numel=sum(p.numel() for p in storage.params),
            nbytes=storage.nbytes,
            dtype=str(storage.params[0].dtype),
            parameter_names=tuple(names[i] for i in storage.param_indices),
            sparse=storage.sparse,
            launches=launches[b] if b < len(launches) else 0,
            avg_reduce_s=seconds[b] / launches[b] if b < len(launches) and launches[b] else 0.0,
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
    )
