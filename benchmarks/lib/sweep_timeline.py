"""Where a step's time goes, per shape: gradsync's per-bucket timeline, summarised.

``python -m benchmarks sweep --link 1gbit --timeline SHAPE ...`` trains gradsync at its defaults on
each shape inside ``gradsync.trace`` (observability/trace.py) and reads the recorded phases back
per iteration (rank 0's clock):

- ``forward``, ``buffer sync``, ``backward compute`` (first gradient hook to the end of autograd's
  work), ``exposed wait`` (backward done to every bucket reduced), ``write-back`` (averages into .grad);
- per bucket: its bytes, when it was ready and launched (ms after backward's first hook) and when
  its all-reduce finished;
- ``link idle``: inside the window from the first launch to the last completion, the time no bucket's
  all-reduce was in flight (the link waiting for backward to produce the next bucket);
- ``last bucket``: from the last bucket's launch (or the previous one's completion, if later: gloo
  runs collectives in order) to its completion: what no overlap can hide.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

STEP_PHASES = ("forward", "buffer_sync", "backward_compute", "wait_for_reductions", "write_grads")


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    ready_ms: float  # after backward's first gradient hook
    launch_ms: float
    done_ms: float


@dataclass(frozen=True)
class Iteration:
    phases_ms: dict[str, float]
    buckets: list[Bucket]

    def link_idle_ms(self) -> float:
        """Gaps inside [first launch, last completion] where no all-reduce was in flight."""
        spans = sorted((b.launch_ms, b.done_ms) for b in self.buckets)
        idle, reach = 0.0, spans[0][1]
        for start, end in spans[1:]:
            idle += max(start - reach, 0.0)
            reach = max(reach, end)
        return idle

    def last_bucket_ms(self) -> float:
        ordered = sorted(self.buckets, key=lambda b: b.launch_ms)
        last = ordered[-1]
        start = max(last.launch_ms, ordered[-2].done_ms) if len(ordered) > 1 else last.launch_ms
        return last.done_ms - start


def iterations(events: list[dict[str, Any]]) -> list[Iteration]:
    """One ``Iteration`` per traced step, from a rank's ``Timeline.events``."""
    by_iter: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        by_iter[event["args"]["iteration"]].append(event)
    result = []
    for _, evs in sorted(by_iter.items()):
        phases = {e["name"]: e["dur"] / 1e3 for e in evs if e["track"] == "step"}
        origin = next((e["ts"] for e in evs if e["name"] == "backward_compute"), None)
        if origin is None:
            continue
        ready = {e["track"]: e["ts"] for e in evs if e["name"] == "waiting_for_earlier_buckets"}
        buckets = [
            Bucket(
                e["args"]["bytes"],
                (ready.get(e["track"], e["ts"]) - origin) / 1e3,
                (e["ts"] - origin) / 1e3,
                (e["ts"] + e["dur"] - origin) / 1e3,
            )
            for e in evs
            if e["name"] == "all_reduce"
        ]
        if buckets:
            result.append(Iteration(phases, buckets))
    return result


def summary_row(
    shape: str, its: list[Iteration], flat_ms: float, forward_ms: float, bare_ms: float, step_ms: float
) -> str:
    """Medians over the traced iterations, one markdown row."""

    def med(values: list[float]) -> float:
        return statistics.median(values)

    phases = [med([it.phases_ms.get(p, 0.0) for it in its]) for p in STEP_PHASES]
    first_launch = med([min(b.launch_ms for b in it.buckets) for it in its])
    window = med([max(b.done_ms for b in it.buckets) - min(b.launch_ms for b in it.buckets) for it in its])
    cells = " | ".join(f"{v:.1f}" for v in phases)
    return (
        f"| {shape} | {len(its[0].buckets)} | {cells} | {first_launch:.1f} | {window:.1f} "
        f"| {med([it.link_idle_ms() for it in its]):.1f} | {med([it.last_bucket_ms() for it in its]):.1f} "
        f"| {forward_ms:.1f} | {flat_ms:.1f} | {bare_ms:.1f} | {step_ms:.1f} |"
    )


SUMMARY_HEADER = [
    "| shape | buckets | forward | buffer sync | backward compute | exposed wait | write-back | first launch "
    "| comm window | link idle in window | last bucket | forward_only (bare) | flat all-reduce | no_comm step "
    "| gradsync step (untraced) |",
    "|---|---:|" + "---:|" * 13,
]


def bucket_rows(shape: str, it: Iteration) -> list[str]:
    return [
        f"| {shape} | {k} | {b.nbytes / 2**20:.2f} | {b.ready_ms:.1f} | {b.launch_ms:.1f} | {b.done_ms:.1f} "
        f"| {b.done_ms - b.launch_ms:.1f} |"
        for k, b in enumerate(sorted(it.buckets, key=lambda b: b.launch_ms))
    ]


BUCKET_HEADER = [
    "| shape | bucket (launch order) | MiB | ready ms | launched ms | done ms | launch to done ms |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
