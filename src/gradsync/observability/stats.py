"""``ddp.stats()``: the buckets and per-iteration averages, as a table for people and a dict for loggers.

``print(ddp.stats())`` shows one row per bucket and the phase averages; ``ddp.stats().as_dict()``
gives the same numbers as plain values (seconds and bytes) for a metrics logger. The engine fills
it from its running sums (timing.py); torch's ``_get_ddp_logging_data()`` reads the same numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_MIB = 1024 * 1024


@dataclass(frozen=True)
class BucketInfo:
    """One bucket as it is now; ``launches`` and ``avg_reduce_s`` count since it was built."""

    index: int
    numel: int
    nbytes: int
    dtype: str
    parameter_names: tuple[str, ...]
    sparse: bool
    launches: int = 0  # reductions of this bucket completed
    # From its launch until its completion was seen (callback or wait), averaged over the reductions timed:
    # all of them on CPU, a sample on CUDA ([Note: sampled bucket completions] in cuda_clock.py).
    avg_reduce_s: float = 0.0
    timed: int = 0  # how many of ``launches`` ``avg_reduce_s`` averages: their total time is the product


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
    # What the times were measured with: "host clock" on CPU, "CUDA events" on CUDA (cuda_clock.py).
    timing: str = "host clock"

    @property
    def exposed_comm_share(self) -> float:
        """The share of backward spent waiting for communication after autograd finished."""
        return self.avg_exposed_comm_s / self.avg_backward_s if self.avg_backward_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (buckets a list of dicts, names lists), for loggers."""
        values: dict[str, Any] = _lists(dataclasses.asdict(self))
        values["exposed_comm_share"] = self.exposed_comm_share
        return values

    def __str__(self) -> str:
        return "\n".join([self._title(), *_bucket_table(self.buckets), *self._averages()])

    def _title(self) -> str:
        rebuilt = "rebuilt in gradient-ready order" if self.buckets_rebuilt else "in construction order"
        hook = self.comm_hook or "none (all-reduce)"
        return (
            f"gradsync DDP, rank {self.rank} of {self.world_size}: {self.iterations} synced iteration(s), "
            f"{len(self.buckets)} bucket(s) {rebuilt}, comm hook: {hook}"
        )

    def _averages(self) -> list[str]:
        ms = 1e3
        unused = ", ".join(self.unused_parameters) if self.unused_parameters else "none"
        flags = (
            f"find_unused_parameters={self.find_unused_parameters}, static_graph={self.static_graph}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}"
        )
        return [
            f"per iteration (average of {self.iterations}; {self.timing}):",
            f"  forward                 {self.avg_forward_s * ms:9.2f} ms",
            f"  buffer sync             {self.avg_buffer_sync_s * ms:9.2f} ms",
            f"  backward                {self.avg_backward_s * ms:9.2f} ms  (first gradient to .grad written)",
            f"  communication           {self.avg_comm_s * ms:9.2f} ms  (first launch to last completion)",
            f"  exposed communication   {self.avg_exposed_comm_s * ms:9.2f} ms  "
            f"({100 * self.exposed_comm_share:.0f}% of backward: waited for after autograd finished)",
            f"  reduced                 {_size(self.bytes_reduced_per_iteration):>12}  "
            f"({_size(self.total_bytes_reduced)} in all)",
            f"unused parameters in the last iteration: {unused}",
            f"settings: {flags}",
        ]


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(item) for item in value]
    return value


def _bucket_table(buckets: tuple[BucketInfo, ...]) -> list[str]:
    header = (
        f"{'bucket':>6}  {'size':>10}  {'params':>6}  {'dtype':<9}  {'launches':>8}  {'avg reduce':>10}  parameters"
    )
    rows = [header]
    for info in buckets:
        kind = "sparse" if info.sparse else info.dtype.replace("torch.", "")
        rows.append(
            f"{info.index:>6}  {_size(info.nbytes):>10}  {len(info.parameter_names):>6}  {kind:<9}  "
            f"{info.launches:>8}  {info.avg_reduce_s * 1e3:>7.2f} ms  {_names(info.parameter_names)}"
        )
    total = sum(info.nbytes for info in buckets)
    count = sum(len(info.parameter_names) for info in buckets)
    rows.append(f"{'total':>6}  {_size(total):>10}  {count:>6}")
    return rows


def _size(nbytes: int) -> str:
    if nbytes >= _MIB:
        return f"{nbytes / _MIB:.2f} MiB"
    if nbytes >= 1024:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes} B"


def _names(names: tuple[str, ...], width: int = 48) -> str:
    """The first and last parameter of a bucket (buckets hold runs of the backward order)."""
    text = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
    return text if len(text) <= width else text[: width - 3] + "..."
