"""``ddp.stats()``: the buckets and the per-iteration averages of the running sums (timing.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketInfo:
    index: int
    numel: int
    nbytes: int
    dtype: str
    parameter_names: tuple[str, ...]
    sparse: bool


@dataclass(frozen=True)
class DDPStats:
    """A public, documented view of what torch keeps in ``_get_ddp_logging_data()``.

    Times are seconds, averaged over the synced iterations seen so far (``iterations``).
    """

    rank: int
    world_size: int
    buckets: tuple[BucketInfo, ...]
    buckets_rebuilt: bool
    iterations: int
    avg_forward_s: float
    avg_backward_s: float
    avg_comm_s: float
    avg_exposed_comm_s: float
    avg_buffer_sync_s: float
    bytes_reduced_per_iteration: int
    total_bytes_reduced: int
    unused_parameters: tuple[str, ...]  # locally unused in the last synced iteration
    comm_hook: str | None
    find_unused_parameters: bool
    static_graph: bool
    gradient_as_bucket_view: bool
