"""``bucket_cap_mb="auto"``: bucket sizes chosen from measured all-reduce cost.

[Note: choosing the cap]
An all-reduce of ``n`` bytes costs about ``latency + n / bandwidth``. Small buckets start
reducing early and leave little to reduce after backward ends, but each pays the latency
once; large buckets amortise latency but expose more communication at the end. We
measure latency (a 4 KiB all-reduce) and bandwidth (a 4 MiB one) once at construction,
take the slowest rank's numbers so every rank computes the same caps, and pick the
smallest bucket whose latency is at most ``LATENCY_SHARE`` of its transfer time, then
clamp it so the model splits into at least ``MIN_BUCKETS`` buckets and stays within
[``MIN_CAP``, 25 MiB]. The first bucket gets the same cap.

Small buckets only pay off if communication actually runs *while* backward computes. Where
the collective and the compute share the same cores (a CPU box with a rank per core, as in
our development machine) it does not: the reduction just takes turns with backward, and
every extra bucket costs another collective's fixed price (about 1.3 ms of CPU per rank
here for a tiny gloo all-reduce). So we also measure the overlap: the 4 MiB all-reduce
alone, a matmul loop of about the same length alone, and both at once. If less than
``MIN_OVERLAP`` of the shorter one hides behind the other (slowest rank), the cap is 25 MiB:
as few buckets as the default allows. Cost: about a dozen small all-reduces and ~0.1 s of
probing once, at construction.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from .buckets import DEFAULT_BUCKET_CAP_MB, MIB

logger = logging.getLogger(__name__)

LATENCY_SHARE = 0.1
MIN_OVERLAP = 0.5  # below this share of hidden communication, small buckets cost more than they save
MIN_BUCKETS = 4
MIN_CAP = 256 * 1024
PROBE_SMALL = 4 * 1024
PROBE_LARGE = 4 * MIB
REPEATS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all_reduce(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> float:
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(REPEATS + 1):  # the first run warms the connection up
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _overlap(all_reduce_s: float, group: dist.ProcessGroup, device: torch.device) -> float:
    """Share (0-1) of the shorter of (all-reduce, compute) that hides behind the other on this rank."""
    matrix = torch.randn(128, 128, device=device)
    start = time.perf_counter()
    for _ in range(4):
        matrix @ matrix
    _sync(device)
    steps = max(1, min(10_000, int(all_reduce_s / max((time.perf_counter() - start) / 4, 1e-7))))

    def compute() -> float:
        begin = time.perf_counter()
        for _ in range(steps):
            matrix @ matrix
        _sync(device)
        return time.perf_counter() - begin

    tensor = torch.zeros(PROBE_LARGE // 4, dtype=torch.float32, device=device)
    compute_s = both_s = float("inf")
    for _ in range(REPEATS):
        dist.barrier(group=group)
        compute_s = min(compute_s, compute())
        dist.barrier(group=group)
        begin = time.perf_counter()
        work = dist.all_reduce(tensor, group=group, async_op=True)
        compute()
        work.wait()
        _sync(device)
        both_s = min(both_s, time.perf_counter() - begin)
    hidden = all_reduce_s + compute_s - both_s
    return max(0.0, min(1.0, hidden / max(min(all_reduce_s, compute_s), 1e-9)))


def measure(group: dist.ProcessGroup, device: torch.device) -> tuple[float, float, float]:
    """(latency in seconds, bandwidth in bytes/second, overlap 0-1), the same on every rank."""
    small = _time_all_reduce(PROBE_SMALL, group, device)
    large = _time_all_reduce(PROBE_LARGE, group, device)
    overlap = _overlap(large, group, device)
    # The slowest rank's numbers; 1 - overlap so that MAX picks the worst overlap too.
    slowest = torch.tensor([small, large, 1.0 - overlap], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    small, large, no_overlap = slowest.tolist()
    bandwidth = (PROBE_LARGE - PROBE_SMALL) / max(large - small, 1e-9)
    return small, bandwidth, 1.0 - no_overlap


def choose_cap(latency_s: float, bandwidth_bps: float, total_bytes: int, overlap: float = 1.0) -> int:
    if overlap < MIN_OVERLAP:
        return int(DEFAULT_BUCKET_CAP_MB * MIB)  # nothing to gain from early starts: fewest collectives
    cap = latency_s * bandwidth_bps / LATENCY_SHARE
    cap = min(cap, total_bytes / MIN_BUCKETS)
    return int(max(MIN_CAP, min(cap, DEFAULT_BUCKET_CAP_MB * MIB)))


def auto_bucket_caps(group: dist.ProcessGroup, device: torch.device, total_bytes: int) -> list[int]:
    latency, bandwidth, overlap = measure(group, device)
    cap = choose_cap(latency, bandwidth, total_bytes, overlap)
    logger.info(
        "bucket_cap_mb='auto': latency %.0f us, bandwidth %.2f GB/s, overlap %.2f -> %.2f MiB buckets",
        latency * 1e6,
        bandwidth / 1e9,
        overlap,
        cap / MIB,
    )
    return [cap]
