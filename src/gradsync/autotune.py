"""``bucket_cap_mb="auto"``: bucket sizes chosen from measured all-reduce cost.

[Note: choosing the cap]
An all-reduce of ``n`` bytes costs about ``latency + n / bandwidth``. Small buckets start
reducing early and leave little to reduce after backward ends, but each pays the latency
once; large buckets amortise latency but expose more communication at the end. We
measure latency (a 4 KiB all-reduce) and bandwidth (a 4 MiB one) once at construction,
take the slowest rank's numbers so every rank computes the same caps, and pick the
smallest bucket whose latency is at most ``LATENCY_SHARE`` of its transfer time, then
clamp it so the model splits into at least ``MIN_BUCKETS`` buckets and stays within
[``MIN_CAP``, 25 MiB]. The first bucket gets the same cap. Cost: about a dozen small
all-reduces once, at construction.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .buckets import DEFAULT_BUCKET_CAP_MB, MIB

LATENCY_SHARE = 0.1
MIN_BUCKETS = 4
MIN_CAP = 256 * 1024
PROBE_SMALL = 4 * 1024
PROBE_LARGE = 4 * MIB
REPEATS = 3


def _time_all_reduce(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> float:
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(REPEATS + 1):  # the first run warms the connection up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure(group: dist.ProcessGroup, device: torch.device) -> tuple[float, float]:
    """(latency in seconds, bandwidth in bytes/second), the same on every rank."""
    small = _time_all_reduce(PROBE_SMALL, group, device)
    large = _time_all_reduce(PROBE_LARGE, group, device)
    slowest = torch.tensor([small, large], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    small, large = slowest.tolist()
    bandwidth = (PROBE_LARGE - PROBE_SMALL) / max(large - small, 1e-9)
    return small, bandwidth


def choose_cap(latency_s: float, bandwidth_bps: float, total_bytes: int) -> int:
    cap = latency_s * bandwidth_bps / LATENCY_SHARE
    cap = min(cap, total_bytes / MIN_BUCKETS)
    return int(max(MIN_CAP, min(cap, DEFAULT_BUCKET_CAP_MB * MIB)))


def auto_bucket_caps(group: dist.ProcessGroup, device: torch.device, total_bytes: int) -> list[int]:
    latency, bandwidth = measure(group, device)
    return [choose_cap(latency, bandwidth, total_bytes)]
