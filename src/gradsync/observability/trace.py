"""A per-bucket timeline of training steps, as Chrome-trace / Perfetto JSON and a PNG.

Use::

    with gradsync.trace(ddp, "step_trace.json", png="overlap.png"):
        for batch in loader:
            ...train step...

On exit every rank sends its events to rank 0 (one collective), which writes one
merged file: a process per rank, a thread for the step's phases and one per bucket.
Open it at https://ui.perfetto.dev or chrome://tracing. Times are wall-clock
microseconds, so ranks on one machine line up; across machines they are as good as
the hosts' clock sync.

Cost: off, nothing (the reducer checks one attribute per bucket); on, a completion
callback per bucket and a few list appends per iteration (see docs/observability.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from .timing import IterationTimes


@dataclass
class Timeline:
    """Collects the phases of every synced iteration on this rank."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    # Map perf_counter onto wall-clock time once, so all ranks share a time axis.
    _wall_minus_perf: float = field(default_factory=lambda: time.time() - time.perf_counter())

    def _us(self, t: float) -> float:
        return (t + self._wall_minus_perf) * 1e6

    def _span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        if start and end and end >= start:
            self.events.append(
                {"name": name, "track": track, "ts": self._us(start), "dur": (end - start) * 1e6, "args": args}
            )

    def add_iteration(self, iteration: int, times: IterationTimes, bucket_bytes: list[int]) -> None:
        self._span("step", "forward", times.forward_start, times.forward_end, iteration=iteration)
        self._span("step", "buffer_sync", times.buffer_sync_start, times.buffer_sync_end, iteration=iteration)
        self._span("step", "backward_compute", times.backward_start, times.finalize_start, iteration=iteration)
        self._span("step", "wait_for_reductions", times.finalize_start, times.reductions_done, iteration=iteration)
        self._span("step", "write_grads", times.reductions_done, times.finalize_end, iteration=iteration)
        for b in range(times.num_buckets):
            track = f"bucket {b}"
            ready, launch, done = times.bucket_ready[b], times.bucket_launch[b], times.bucket_done[b]
            self._span(track, "waiting_for_earlier_buckets", ready, launch, iteration=iteration)
            self._span(track, "all_reduce", launch, done, iteration=iteration, bytes=bucket_bytes[b])


def to_chrome_trace(per_rank_events: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Merge every rank's events: process = rank, thread = phase track or bucket."""
    trace_events: list[dict[str, Any]] = []
    for rank, events in enumerate(per_rank_events):
        trace_events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        tracks = sorted({e["track"] for e in events}, key=lambda t: (t != "step", len(t), t))
        tids = {track: i for i, track in enumerate(tracks)}
        for track, tid in tids.items():
            trace_events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for event in events:
            trace_events.append(
                {
                    "ph": "X",
                    "name": event["name"],
                    "pid": rank,
                    "tid": tids[event["track"]],
                    "ts": event["ts"],
                    "dur": event["dur"],
                    "args": event["args"],
                }
            )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_png(per_rank_events: list[list[dict[str, Any]]], path: str) -> None:
    """A Gantt chart of the phases and bucket reductions (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # optional dependency
        raise RuntimeError("png= needs matplotlib: pip install 'gradsync[plot]'") from error
    colors = {"forward": "tab:blue", "backward_compute": "tab:green", "all_reduce": "tab:red"}
    rows: list[str] = []
    start = min((e["ts"] for events in per_rank_events for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 1 + 0.35 * sum(len({e["track"] for e in ev}) for ev in per_rank_events)))
    for rank, events in enumerate(per_rank_events):
        for event in events:
            row = f"rank {rank} · {event['track']}"
            if row not in rows:
                rows.append(row)
            y = rows.index(row)
            color = colors.get(event["name"], "tab:gray")
            ax.broken_barh([((event["ts"] - start) / 1e3, event["dur"] / 1e3)], (y - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title(
        "gradsync: forward (blue), backward compute (green), waiting for reductions (gray), bucket all-reduce (red)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Traceable(Protocol):
    """What ``trace`` needs of a wrapper: its process group, and a place for the timeline."""

    process_group: dist.ProcessGroup

    def set_timeline(self, timeline: Timeline | None) -> None: ...


@contextmanager
def trace(ddp: Traceable, path: str, png: str | None = None) -> Iterator[Timeline]:
    """Record every synced iteration inside the block; rank 0 writes ``path`` (and ``png``)."""
    group = ddp.process_group
    timeline = Timeline(rank=dist.get_rank(group))
    ddp.set_timeline(timeline)
    try:
        yield timeline
    finally:
        ddp.set_timeline(None)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, timeline.events, group=group)
    if dist.get_rank(group) == 0:
        with open(path, "w") as f:
            json.dump(to_chrome_trace(gathered), f)
        if png is not None:
            write_png(gathered, png)
