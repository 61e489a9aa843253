"""What every study shares: interleaved timing, summaries, and the report header.

[Note: how an iteration is timed]
A contender is anything with a ``step(i)`` that runs one iteration. Contenders run in
rounds, interleaved (A B C, then B C A, ...), so slow drift on the machine hits them all
alike. Rotated, a contender still follows the same neighbour in all but one round of n, so
whatever that neighbour leaves behind (a freed heap, evicted caches) would weigh on it every round.
``shuffle=True`` draws each round's order instead (seeded by the round, the same on every
rank), so each contender follows every other about equally often. Each block of iterations
starts after a barrier, and an iteration's time is the slowest rank's (one all-reduce
MAX per block, outside the timed region): a step is done only when every rank is.

[Note: per-step maxima and block times]
The slowest rank's time per step is the right measure when every step synchronises the
ranks (DDP): no rank can run ahead. Where the ranks meet only now and then (DiLoCo's outer
steps, or never: no communication), a rank that was slower through the block is counted in
every step's maximum *and* again where the faster rank waits for it at the next collective:
the sum of per-step maxima double-counts the ranks' drift at each meeting. What such a job
delivers is the block's wall-clock on its slowest rank, the sum of that rank's own steps;
``interleave(..., blocks=...)`` records it (and the fastest rank's, whose difference is the
drift) for the studies that compare such contenders.

[Note: a shared machine]
On a small box other processes steal cores from the ranks. ``MachineLoad`` records the
load average and the CPU time other processes used while we measured, so a report says
how quiet the machine really was, not just how quiet it was when we started.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync
from benchmarks.lib import link
from gradsync.ddp import TorchDDP as TORCH_DDP  # noqa: F401 - torch's own class, even under GRADSYNC_INSTALL=1

# GRADSYNC_BENCH_RESULTS redirects scratch runs, so they do not overwrite a kept report.
BOOTSTRAP_RESAMPLES = 2000
RESULTS_DIR = Path(os.environ.get("GRADSYNC_BENCH_RESULTS", Path(__file__).resolve().parents[1] / "results"))
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- timing
@dataclass
class Contender:
    name: str
    step: Callable[[int], None]  # one iteration; ``i`` picks the batch
    rest: Callable[[], None] = field(default=lambda: None)  # after each block, untimed (frees .grad)
    # Before each block, untimed: for setups whose iteration leaves work to the next one (all-gathers that
    # overlap the next forward), one iteration that leaves it, so that every timed iteration pays for one.
    lead: Callable[[], None] = field(default=lambda: None)


def time_block(contender: Contender, count: int) -> list[float]:
    """Seconds per iteration on this rank."""
    contender.lead()
    times = []
    for i in range(count):
        start = time.perf_counter()
        contender.step(i)
        times.append(time.perf_counter() - start)
    contender.rest()
    return times


def slowest_rank(times: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Per iteration, the maximum over ranks (one collective per block, outside the timing)."""
    tensor = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def slowest_and_fastest_block(times: list[float], group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """The block's wall-clock on the slowest rank and on the fastest (sums of each rank's own steps)."""
    total = sum(times)
    tensor = torch.tensor([total, -total], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor[0].item(), -tensor[1].item()


def interleave(
    contenders: list[Contender],
    rounds: int,
    iters: int,
    warmup: int,
    after_warmup: Callable[[], None] | None = None,
    blocks: dict[str, list[tuple[float, float]]] | None = None,
    shuffle: bool = False,
) -> dict[str, list[float]]:
    """Warm every contender up, then time ``rounds`` blocks of ``iters`` iterations each (rotated, or in
    ``round_order``'s shuffled order: [Note: how an iteration is timed]).

    Returns each iteration's time on the slowest rank. ``blocks``, where given, receives each block's
    wall-clock on the slowest and on the fastest rank ([Note: per-step maxima and block times]).
    """
    for contender in contenders:  # warm-up includes the DDPs' bucket rebuild after iteration 1
        dist.barrier()
        time_block(contender, warmup)
    if after_warmup is not None:
        after_warmup()
    samples: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        for contender in round_order(contenders, r, shuffle):
            dist.barrier()  # start each block together, so no rank's head start is timed
            times = time_block(contender, iters)
            samples[contender.name] += slowest_rank(times)
            if blocks is not None:
                blocks.setdefault(contender.name, []).append(slowest_and_fastest_block(times))
    return samples


def round_order(contenders: list[Contender], r: int, shuffle: bool) -> list[Contender]:
    """Round ``r``'s order: rotated by ``r``, or drawn from a generator seeded by ``r`` (every rank alike)."""
    if shuffle:
        return random.Random(r).sample(contenders, len(contenders))
    return contenders[r % len(contenders) :] + contenders[: r % len(contenders)]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    after_backward: Callable[[], None] | None = None,
) -> Callable[[int], None]:
    """zero_grad, forward, loss, backward (, e.g. the naive all-reduce), optimizer step."""

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss(model(x), y).backward()  # both DDPs have waited for every all-reduce when this returns
        if after_backward is not None:
            after_backward()
        optimizer.step()

    return step


# ---------------------------------------------------------------------- summaries
@dataclass(frozen=True)
class Summary:
    median_ms: float
    p90_ms: float
    count: int


def summarise(times: list[float]) -> Summary:
    ms = [t * 1e3 for t in times]
    p90 = statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]
    return Summary(statistics.median(ms), p90, len(ms))


def per_block(
    samples: list[float], iters: int, rounds: int, statistic: Callable[[list[float]], float] = statistics.median
) -> list[float]:
    """``statistic`` of each of the first ``rounds`` blocks of ``iters`` iterations (one block per round)."""
    return [statistic(samples[r * iters : (r + 1) * iters]) for r in range(rounds)]


def round_ratios(
    samples: list[float],
    reference: list[float],
    iters: int,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> list[float]:
    """Each round's ``statistic`` of ``samples`` over that of ``reference`` in the same round."""
    rounds = min(len(samples), len(reference)) // iters
    return [
        a / b
        for a, b in zip(per_block(samples, iters, rounds, statistic), per_block(reference, iters, rounds, statistic))
    ]


def geometric_mean_interval(ratios: list[float], quantile: float) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and ``mean +- quantile * standard error`` in the log, back as ratios."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = quantile * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_ratio(
    samples: list[float],
    reference: list[float],
    iters: int,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> tuple[float, float, float]:
    """Median over rounds of (this round's median / the reference's median in the same round), with a 90% CI.

    ``statistic=statistics.fmean`` compares blocks by their mean iteration instead (throughput: an
    occasional long iteration counts in full).

    Contenders run interleaved, so a round's two blocks saw the same machine state; the
    per-round ratio cancels drift that the ratio of overall medians keeps. The interval is a
    percentile bootstrap over rounds (fixed seed, so a report can be regenerated).
    """
    per_round = round_ratios(samples, reference, iters, statistic)
    rounds = len(per_round)
    rng = random.Random(0)
    resamples = sorted(statistics.median(rng.choices(per_round, k=rounds)) for _ in range(BOOTSTRAP_RESAMPLES))
    low = resamples[int(0.05 * BOOTSTRAP_RESAMPLES)]
    high = resamples[int(0.95 * BOOTSTRAP_RESAMPLES) - 1]
    return statistics.median(per_round), low, high


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


# ---------------------------------------------------------------------- the machine
def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _busy_cpu_s() -> float:
    """CPU seconds all processes on the machine spent busy since boot (from /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """Load average at the start, and the CPU other processes used while we measured.

    Every rank calls ``start`` and ``stop`` (collectives); rank 0 reads the result.
    ``other_cpu_s`` is the machine's busy CPU time minus what all ranks used themselves.
    """

    def start(self) -> None:
        self.load_at_start = loadavg()
        self._wall, self._busy, self._own = time.perf_counter(), _busy_cpu_s(), time.process_time()

    def stop(self) -> None:
        own = torch.tensor([time.process_time() - self._own], dtype=torch.float64)
        dist.all_reduce(own)
        self.wall_s = time.perf_counter() - self._wall
        self.other_cpu_s = max(_busy_cpu_s() - self._busy - own.item(), 0.0)
        self.load_at_end = loadavg()

    def other_cores(self) -> float:
        return self.other_cpu_s / self.wall_s

    def describe(self) -> str:
        return (
            f"load average (1, 5, 15 min) {self.load_at_start} at the start, {self.load_at_end} at the end "
            f"(our own ranks add ~{dist.get_world_size()}); other processes used {self.other_cpu_s:.0f} CPU-s "
            f"during the {self.wall_s:.0f} s measured, i.e. {self.other_cpu_s / self.wall_s:.2f} cores on average"
        )


def wait_for_quiet(max_cores: float = 0.3, window_s: float = 5.0, max_wait_s: float = 600.0) -> float:
    """Every rank: sleep until other processes use under ``max_cores`` cores; returns seconds waited.

    All ranks sleep through each ``window_s`` window, so whatever CPU the machine spent in
    it was other processes'. Gives up (and measures anyway) after ``max_wait_s``.
    """
    start = time.perf_counter()
    while True:
        dist.barrier()
        busy = _busy_cpu_s()
        time.sleep(window_s)
        others = torch.tensor([(_busy_cpu_s() - busy) / window_s])
        dist.broadcast(others, src=0)  # rank 0's reading decides for everyone
        waited = time.perf_counter() - start
        if others.item() < max_cores or waited > max_wait_s:
            return waited
        if dist.get_rank() == 0:
            print(f"other processes use {others.item():.2f} cores; waiting for a quiet machine", flush=True)
        time.sleep(20.0)


def add_shape_study_options(parser: argparse.ArgumentParser, kind: str) -> None:
    """The options the studies over lib/shapes.py's grid share: ``--wait-for-quiet``, ``--label``, ``--link``."""
    parser.add_argument(
        "--wait-for-quiet",
        type=float,
        default=30.0,
        help="before each shape, wait up to this many seconds for other processes to use under 0.3 cores (0: never)",
    )
    parser.add_argument("--label", default="", help=f"appended to the report's name: {kind}-LABEL[-RATE].md")
    parser.add_argument(
        "--link",
        help="rate of a shaped loopback link (1gbit, 10gbit, ...): start with python, not torchrun (see lib/link.py)",
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------- the report
def revision() -> str:
    """The commit the numbers belong to, with a fingerprint of uncommitted changes in src/."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        diff = subprocess.run(["git", "diff", "HEAD", "--", "src"], cwd=REPO, capture_output=True, text=True)
        new = subprocess.run(
            ["git", "ls-files", "--others", "--exclude-standard", "src"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    if not diff.stdout.strip() and not new.stdout.strip():
        return head.stdout.strip()
    fingerprint = hashlib.sha1((diff.stdout + new.stdout).encode()).hexdigest()[:8]
    untracked = f", untracked {new.stdout.split()}" if new.stdout.strip() else ""
    return f"{head.stdout.strip()} + uncommitted changes in src/ (diff sha1 {fingerprint}{untracked})"


def processor() -> str:
    """The CPU model and the vector instructions torch's kernels use on it. Two 2-core machines of this
    project ran the same step 2-3x apart (an AMD EPYC with AVX2 against the earlier reports' machine, which
    they did not name), and which form of a product is fastest can change with the CPU: a report without
    this line cannot be compared with another."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return f"{model}, torch's CPU kernels: {capability}"


def environment_lines(command: str) -> list[str]:
    return [
        f"Command: `{command}`",
        "",
        f"- torch {torch.__version__}, Python {platform.python_version()}, gradsync {gradsync.__version__} "
        f"(commit {revision()})",
        f"- world size {dist.get_world_size()}, backend {dist.get_backend()}, {os.cpu_count()} CPU cores on the "
        f"machine, torch threads per rank {torch.get_num_threads()}",
        f"- {platform.platform()}; {processor()}",
        f"- link: {link.describe()}",
    ]


def report_path(kind: str, suffix: str = "md") -> Path:
    """``results/YYYY-MM-DD-KIND[-RATE].SUFFIX``: a shaped link's report does not replace plain loopback's."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    rate = link.current()
    kind = kind if rate is None else f"{kind}-{rate}"
    return RESULTS_DIR / f"{datetime.date.today().isoformat()}-{kind}.{suffix}"


def today() -> str:
    return datetime.date.today().isoformat()
