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

[Note: the default caps]
With ``bucket_cap_mb=None`` gradsync uses torch's caps (1 MiB first bucket, then 25 MiB), except
for a CPU model with at least ``ADAPT_MIN_BYTES`` of gradients. There it asks whether a
collective *waits* on the link or *computes*: the process's CPU time during a 4 MiB all-reduce
over its wall time (median of a few, the largest over ranks). On plain loopback gloo's threads
copy the bytes themselves, 0.4-1.0 CPU seconds per second; through a 1 Gbit/s link they wait,
0.03-0.06. Below ``WAIT_SHARE`` the collective would hide behind backward if it started early, so
the model is cut into ``LINK_BUCKETS`` buckets (within 256 KiB-25 MiB): a cap from the model's size
alone, the same in every run, unlike "auto"'s latency-based one, which varied 0.25-2.5 MiB from one
construction to the next through the shaper. On transformer at 1 Gbit/s, 4 MiB buckets gave 0.90x
torch DDP's step and "auto"'s smaller ones 0.87-0.88x in the same runs, hence eight buckets
(2 MiB: 0.89x; benchmarks/results/2026-11-30-shaped-link.md). Models from 512 KiB of gradients
on are probed (first from 4 MiB: cnn_bn's 0.7 MiB, one bucket, stayed at torch's step while
smaller buckets gave 0.84-0.88x of it at 1 Gbit/s; 2026-12-01 report). The
overlap probe "auto" uses was too noisy to decide a default (on loopback it said "overlaps" in 1
of 3 constructions); the CPU share separates the two cases by a factor of ten. Tiny models skip
the probe (one bucket of under 512 KiB costs little either way), so does ``init_sync=False`` (it
promises no collective at construction) and so do GPUs (process CPU time does not see NCCL's
work). ``bucket_cap_mb_list=[1, 25]`` asks for torch's layout whatever the link.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from ..engine.buckets import DEFAULT_BUCKET_CAP_MB, MIB, bucket_caps_bytes

logger = logging.getLogger(__name__)

LATENCY_SHARE = 0.1
MIN_OVERLAP = 0.5  # below this share of hidden communication, small buckets cost more than they save
MIN_BUCKETS = 4
MIN_CAP = 256 * 1024
ADAPT_MIN_BYTES = MIB // 2  # [Note: the default caps]
WAIT_SHARE = 0.25  # CPU seconds per wall second of an all-reduce below which it waits on a link
LINK_BUCKETS = 8  # how many buckets the default cuts a model into when its collectives wait
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


def default_caps_from(total_bytes: int, cpu_share: float) -> list[int]:
    """[Note: the default caps] once measured: torch's unless the collective waits on a link."""
    if cpu_share >= WAIT_SHARE:
        return bucket_caps_bytes(None, None)
    return [int(max(MIN_CAP, min(total_bytes / LINK_BUCKETS, DEFAULT_BUCKET_CAP_MB * MIB)))]


def _cpu_share(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> float:
    """Median over a few all-reduces of ``nbytes``: process CPU seconds per wall second."""
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor, group=group)  # warm the connection up
    shares = []
    for _ in range(REPEATS + 2):
        dist.barrier(group=group)
        wall, cpu = time.perf_counter(), time.process_time()
        dist.all_reduce(tensor, group=group)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        shares.append(cpu / max(wall, 1e-9))
    return sorted(shares)[len(shares) // 2]


def prefers_few_buckets(hook_state: object) -> bool:
    """[Note: caps under a compressing hook]
    The default cuts a model into small buckets on a slow link so that uncompressed all-reduces
    start early and hide behind backward. A hook that sends a small fraction of the bytes gains
    nothing from that and pays a latency, a round and a wait for the other ranks per bucket (PowerSGD:
    two small all-reduces per bucket): on transformer at 1 Gbit/s it took 1.20x the no-communication
    step with eight buckets and 1.12-1.14x with torch's two (2026-11-30). Its state says so
    (``prefers_few_buckets``), and the default then puts the whole model in one bucket from the
    rebuild after iteration 0 on, as torch's ``powerSGD_hook`` must run on gloo. Against torch's two
    caps, same run, 1 Gbit/s, PowerSGD rank 1: 0.92-0.98x the step on five decoders, 1.00 on the conv
    net (benchmarks/results/2026-12-06-ab-powersgd-one-bucket-1gbit.md).

    The same holds where the default keeps torch's caps (plain loopback, a fast link, a model too small
    to probe): torch's 1 MiB first bucket is a second round of products and all-reduces that cannot
    overlap backward on a CPU (each rank has one core): one bucket took 0.90-0.99x the step on loopback
    and 0.84-0.98x at 10 Gbit/s on models of 1-25 MiB (benchmarks/results/2026-12-07-ab-powersgd-one-bucket-*.md,
    same-run A/Bs against torch's caps). So on a CPU every default layout becomes
    one bucket under such a hook. On a GPU the hook's products could run beside backward; untested, so
    GPUs keep the default's caps. Caps the user chose (``bucket_cap_mb``, ``bucket_cap_mb_list``,
    "auto") are never changed.
    """
    return bool(getattr(hook_state, "prefers_few_buckets", False))


def one_bucket_caps() -> list[int]:
    """A cap no model reaches: every gradient in one bucket."""
    return [1 << 62]


def default_bucket_caps(group: dist.ProcessGroup, device: torch.device, total_bytes: int) -> list[int]:
    """``bucket_cap_mb=None``: torch's caps, or "auto"'s for a large CPU model whose collectives wait on a link."""
    if total_bytes < ADAPT_MIN_BYTES or device.type != "cpu":
        return bucket_caps_bytes(None, None)
    shares = torch.tensor([_cpu_share(PROBE_LARGE, group, device)], dtype=torch.float64, device=device)
    dist.all_reduce(shares, op=dist.ReduceOp.MAX, group=group)  # every rank decides alike
    share = shares.item()
    caps = default_caps_from(total_bytes, share)
    logger.info("default bucket caps: all-reduce CPU share %.2f -> %s MiB", share, [round(c / MIB, 2) for c in caps])
    return caps


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


def starting_caps(
    requested: list[int] | None,
    user_chose: bool,
    agreed: bool,
    group: dist.ProcessGroup,
    device: torch.device,
    total_bytes: int,
) -> tuple[list[int], bool]:
    """The caps a wrapper starts with, and whether they are the default's on a CPU (which a compressing
    hook may replace: [Note: caps under a compressing hook]).

    ``requested``: the resolved argument (None: "auto", measured here); caps the user chose are kept.
    ``agreed``: every rank was checked to hold the same parameters, so the default may probe the link
    (every rank must decide alike, on the same total); unchecked, the default is torch's."""
    if requested is None:
        return auto_bucket_caps(group, device, total_bytes), False
    on_cpu = device.type == "cpu"
    if user_chose:
        return requested, False
    if not agreed:
        return requested, on_cpu
    return default_bucket_caps(group, device, total_bytes), on_cpu
