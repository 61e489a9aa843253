"""``ddp.stats()``: the buckets and the per-iteration averages of the running sums (timing.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.reducer import Reducer


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


def collect_stats(
    reducer: Reducer, *, find_unused_parameters: bool, static_graph: bool, gradient_as_bucket_view: bool
) -> DDPStats:
    running = reducer.running
    buckets = tuple(
        BucketInfo(
            index=b,
            numel=sum(p.numel() for p in storage.params),
            nbytes=storage.nbytes,
            dtype=str(storage.params[0].dtype),
            parameter_names=tuple(reducer.names[i] for i in storage.param_indices),
            sparse=storage.sparse,
        )
        for b, storage in enumerate(reducer.buckets.storages)
    )
    return DDPStats(
        rank=reducer.rank,
        world_size=reducer.world_size,
        buckets=buckets,
        buckets_rebuilt=reducer.rebuilt,
        iterations=running.iterations,
        avg_forward_s=running.average(running.forward_s),
        avg_backward_s=running.average(running.backward_s),
        avg_comm_s=running.average(running.comm_s),
        avg_exposed_comm_s=running.average(running.exposed_comm_s),
        avg_buffer_sync_s=running.average(running.buffer_sync_s),
        bytes_reduced_per_iteration=reducer.buckets.nbytes,
        total_bytes_reduced=running.total_bytes,
        unused_parameters=running.last_unused,
        comm_hook=reducer.hook_name,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
