"""What happened in each synced iteration: phase and bucket timestamps, and their running sums.

Timestamps are ``time.perf_counter()`` seconds, taken a handful of times per iteration and per
bucket (never per parameter), so keeping them always on costs nothing measurable. ``ddp.stats()``
averages the sums (stats.py); ``trace.py`` turns the same timestamps into a timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

now = time.perf_counter


@dataclass
class IterationTimes:
    """Phase boundaries of one synced iteration on this rank (perf_counter seconds)."""

    num_buckets: int
    forward_start: float = 0.0
    forward_end: float = 0.0
    buffer_sync_start: float = 0.0
    buffer_sync_end: float = 0.0
    backward_start: float = 0.0  # first gradient hook of this backward
    finalize_start: float = 0.0  # autograd finished computing gradients
    reductions_done: float = 0.0  # every bucket's reduction waited for
    finalize_end: float = 0.0  # averaged gradients written to .grad
    bucket_ready: list[float] = field(default_factory=list)
    bucket_launch: list[float] = field(default_factory=list)
    bucket_done: list[float] = field(default_factory=list)  # completion seen (callback or wait)
    # Reduced, but this pass did not time their completion (CUDA's sampling: cuda_clock.py); bucket_done 0.0.
    bucket_untimed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bucket_ready = [0.0] * self.num_buckets
        self.bucket_launch = [0.0] * self.num_buckets
        self.bucket_done = [0.0] * self.num_buckets

    @property
    def comm_s(self) -> float:
        """From the first launch to the last completion."""
        launched = [t for t in self.bucket_launch if t]
        return max(self.reductions_done - min(launched), 0.0) if launched else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """Time backward spent waiting for communication after its compute finished."""
        return max(self.reductions_done - self.finalize_start, 0.0)


@dataclass
class RunningStats:
    """Sums over iterations; ``DDPStats`` reports their averages.

    The per-bucket sums cover the buckets as they are now: they start over when the buckets are
    built again (the rebuild after the first iteration, a new process group).
    """

    iterations: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    buffer_sync_s: float = 0.0
    total_bytes: int = 0
    last_unused: tuple[str, ...] = ()
    bucket_launches: list[int] = field(default_factory=list)  # reductions completed, per bucket
    bucket_timed: list[int] = field(default_factory=list)  # of those, the ones whose completion was timed
    bucket_s: list[float] = field(default_factory=list)  # summed launch -> completion seen, per bucket

    def new_layout(self, num_buckets: int) -> None:
        self.bucket_launches = [0] * num_buckets
        self.bucket_timed = [0] * num_buckets
        self.bucket_s = [0.0] * num_buckets

    def add(self, times: IterationTimes, nbytes: int, unused: tuple[str, ...]) -> None:
        self.iterations += 1
        if times.forward_end:
            self.forward_s += times.forward_end - times.forward_start
        self.backward_s += times.finalize_end - times.backward_start
        self.comm_s += times.comm_s
        self.exposed_comm_s += times.exposed_comm_s
        self.buffer_sync_s += times.buffer_sync_end - times.buffer_sync_start
        self.total_bytes += nbytes
        self.last_unused = unused
        if len(self.bucket_launches) != times.num_buckets:
            self.new_layout(times.num_buckets)
        for b, (launch, done) in enumerate(zip(times.bucket_launch, times.bucket_done)):
            if done:  # a bucket skipped (unused, or after a failure) has a launch time but no completion
                self.bucket_launches[b] += 1
                self.bucket_timed[b] += 1
                self.bucket_s[b] += max(done - launch, 0.0)
        for b in times.bucket_untimed:
            self.bucket_launches[b] += 1

    def average_reduce_s(self, b: int) -> float:
        """Bucket ``b``'s mean time from launch to completion, over the reductions that were timed."""
        timed = self.bucket_timed[b] if b < len(self.bucket_timed) else 0
        return self.bucket_s[b] / timed if timed else 0.0

    def average(self, total: float) -> float:
        return total / self.iterations if self.iterations else 0.0
