"""What the ZeRO study (studies/zero.py) compares and how it counts: the sharded setups, bytes, memory.

``build(name, module)`` wraps a module as one of ``DESCRIPTIONS``, every one training with
AdamW: gradsync DDP, gradsync's ``ShardedOptimizer`` (stage 1 and 2), torch DDP with and without
torch's ``ZeroRedundancyOptimizer``, FSDP2 ``fully_shard(reshard_after_forward=False)`` and the
bare module. Three instruments:

- ``WireCounter``: bytes sent on the network namespace's link around a number of steps
  ([Note: bytes on the wire]);
- ``AllocationTrace``: every CPU allocation and free torch's allocator makes while it is open, on
  every thread (a counting C++ wrapper around the allocator, built with ``cpp_extension``), replayed
  into the exact peak of live bytes, and what held them (named by the profiler run alongside)
  ([Note: model-state memory]);
- ``kernel_cost``: minor page faults and system CPU per step;
- ``ANALYTIC``: the bytes per parameter each setup should need (docs/zero.md, fp32 and Adam).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib import link
from benchmarks.lib.common import TORCH_DDP
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.collectives import sharded as sharded_collectives
from gradsync.zero import ShardedOptimizer

LR, WEIGHT_DECAY = 1e-3, 0.01

DESCRIPTIONS = {
    "gradsync_ddp": "gradsync DDP, default arguments, torch.optim.AdamW (the reference)",
    "gradsync_ddp_view": "gradsync DDP with gradient_as_bucket_view=True, torch.optim.AdamW",
    "zero2": "gradsync DDP (default arguments) + ShardedOptimizer(AdamW, stage=2), its defaults (the all-gathers "
    "overlap the next forward)",
    "zero2_view": "gradsync DDP with gradient_as_bucket_view=True + ShardedOptimizer(AdamW, stage=2)",
    "zero2_no_overlap": "zero2 with overlap_param_gather=False (step() waits for the all-gathers)",
    "zero2_backward": "zero2 with step_in_backward=True (each bucket's shard stepped and all-gathered in backward; "
    "the last gathers overlap the next forward)",
    "zero2_backward_no_overlap": "zero2_backward with overlap_param_gather=False",
    "zero2_backward_4mb": "zero2_backward on gradsync DDP with bucket_cap_mb=4 (smaller buckets)",
    "gradsync_ddp_4mb": "gradsync DDP with bucket_cap_mb=4, torch.optim.AdamW",
    "zero2_whole": "zero2 with its exchanges sent as one message per peer (gloo's all_to_all_single, all-gather)",
    "zero2_no_overlap_whole": "zero2_no_overlap with one message per peer",
    "zero2_backward_whole": "zero2_backward with one message per peer",
    "zero1": "gradsync DDP (default arguments) + ShardedOptimizer(AdamW, stage=1), its defaults",
    "zero1_view": "gradsync DDP with gradient_as_bucket_view=True + ShardedOptimizer(AdamW, stage=1)",
    "torch_ddp": "torch DDP, default arguments, torch.optim.AdamW",
    "torch_zero": "torch DDP, default arguments + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)",
    "fsdp2": "FSDP2: fully_shard(reshard_after_forward=False) on every block and the root, AdamW",
    "no_comm": "the bare module with AdamW: each rank trains alone (the floor)",
}


# ---------------------------------------------------------------------- the setups
class TimedOptimizer:
    """An optimizer whose ``step()`` durations are kept (``zero_grad`` and ``step`` as train_step calls them)."""

    def __init__(self, inner: Any, before: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.before = before  # run before each step (the setup's exchange mode)
        self.step_s: list[float] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.before is not None:
            self.before()
        start = time.perf_counter()
        self.inner.step()
        self.step_s.append(time.perf_counter() - start)

    def settle(self) -> None:
        """Wait for communication a step may leave in flight (the overlapped all-gathers)."""
        wait = getattr(self.inner, "wait_for_params", None)
        if wait is not None:
            wait()


def build(name: str, module: nn.Module) -> tuple[nn.Module, TimedOptimizer]:
    """``(model, optimizer)`` for setup ``name``, wrapping ``module`` (every rank, same order: collective)."""
    if name not in DESCRIPTIONS:
        raise ValueError(f"unknown setup {name!r}; choose from {list(DESCRIPTIONS)}")
    adamw: dict[str, Any] = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if name == "no_comm":
        return module, TimedOptimizer(torch.optim.AdamW(module.parameters(), **adamw))
    if name in ("torch_ddp", "torch_zero"):
        model = TORCH_DDP(module)
        if name == "torch_ddp":
            return model, TimedOptimizer(torch.optim.AdamW(model.parameters(), **adamw))
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        return model, TimedOptimizer(zero)
    if name == "fsdp2":
        return fsdp2(module), TimedOptimizer(torch.optim.AdamW(module.parameters(), **adamw))
    caps = {"bucket_cap_mb": 4} if name.endswith("_4mb") else {}
    ddp = GradsyncDDP(module, gradient_as_bucket_view=name.endswith("_view"), **caps)
    whole = name.endswith("_whole")
    name = name.removesuffix("_4mb").removesuffix("_whole")

    def mode(*_: Any) -> None:  # setups run interleaved in one process: each sets the exchange mode it measures
        sharded_collectives.SEGMENTED = not whole

    ddp.register_forward_pre_hook(mode, prepend=True)
    if name.startswith("gradsync_ddp"):
        return ddp, TimedOptimizer(torch.optim.AdamW(ddp.parameters(), **adamw))
    stage = 1 if name.startswith("zero1") else 2
    sharded = ShardedOptimizer(
        ddp,
        torch.optim.AdamW,
        stage=stage,
        overlap_param_gather=not name.endswith("_no_overlap"),
        step_in_backward=name.startswith("zero2_backward"),
        **adamw,
    )
    return ddp, TimedOptimizer(sharded, before=mode)


def shard_units(module: nn.Module) -> list[nn.Module]:
    """FSDP2's units: a transformer's layers, a Sequential's children."""
    blocks = getattr(module, "blocks", None)
    if blocks is not None and hasattr(blocks, "layers"):
        return list(blocks.layers)
    if isinstance(module, nn.Sequential):
        return list(module)
    return []


def fsdp2(module: nn.Module) -> nn.Module:
    """``fully_shard(reshard_after_forward=False)``: ZeRO-2's traffic (all-gather once, reduce-scatter) on FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    return module


def bucket_bytes(model: nn.Module) -> list[int]:
    """The flat buffers' sizes of a gradsync DDP (padded for a sharded optimizer); [] for anything else."""
    engine = getattr(model, "engine", None)
    if engine is None:
        return []
    return [s.flat.numel() * s.flat.element_size() for s in engine.buckets.storages]


# ---------------------------------------------------------------------- bytes on the wire
def sent_bytes(device: str) -> int:
    """Bytes this network namespace has sent on ``device`` (``/proc/net/dev`` is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == device:
            return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError(f"no device {device!r} in /proc/net/dev")


class WireCounter:
    """[Note: bytes on the wire]
    Inside a shaped namespace every byte the ranks exchange crosses one device: the shared
    loopback (``lo``: every rank's sends, counted once, read on rank 0) or, with one link per rank,
    each rank's ``eth0`` (its own sends; summed over ranks). A count is taken between two barriers
    around ``steps`` iterations, after the step's communication has settled; the barriers and the
    store cost a few bytes, which the study removes by subtracting the same count around the bare
    module's steps. TCP/IP headers are counted: about 0.3% at lo's MTU of 65536, under 1% at 9000."""

    def __init__(self) -> None:
        self.device = link.shaped_device()
        self.everyone_counts = link.per_rank()  # else rank 0 reads the shared loopback

    def count(self, step: Callable[[int], None], settle: Callable[[], None], steps: int) -> float:
        """Bytes all ranks sent during ``steps`` calls of ``step`` (every rank calls this)."""
        dist.barrier()
        before = sent_bytes(self.device)
        for i in range(steps):
            step(i)
        settle()
        dist.barrier()
        mine = sent_bytes(self.device) - before
        total = torch.tensor([mine if self.everyone_counts or dist.get_rank() == 0 else 0], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item()


def kernel_cost(step: Callable[[int], None], settle: Callable[[], None], steps: int) -> tuple[float, float]:
    """(minor page faults, system CPU ms) of this rank's process per step, over ``steps`` steps.

    Buffers allocated and freed every step (a bucket released as it drains, a receive buffer) come
    back from the kernel as fresh zero-filled pages when glibc maps them anew: that is system time
    on the training cores, which this makes visible."""
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(steps):
        step(i)
    settle()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (after.ru_minflt - before.ru_minflt) / steps, (after.ru_stime - before.ru_stime) * 1e3 / steps


# ---------------------------------------------------------------------- memory
# A CPU allocator that counts: it wraps torch's, so every tensor allocated after ``install()`` is
# logged with its size when it is made and when it is freed, on whichever thread frees it.
_ALLOCATOR_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

namespace {
enum Kind : int64_t { kMain = 0, kOther = 1, kOpen = 2, kClose = 3 };
std::mutex mutex_;
std::vector<std::tuple<int64_t, int64_t, int64_t>> log_;  // (kind, ptr or label, bytes: negative frees)
std::atomic<bool> logging_{false};
std::thread::id main_;

void note(void* ptr, int64_t nbytes) {
  if (nbytes == 0 || !logging_.load()) return;
  int64_t kind = std::this_thread::get_id() == main_ ? kMain : kOther;
  std::lock_guard<std::mutex> guard(mutex_);
  log_.emplace_back(kind, reinterpret_cast<int64_t>(ptr), nbytes);
}

struct Held { c10::DataPtr inner; int64_t nbytes; };

void release(void* context) {
  auto* held = static_cast<Held*>(context);
  note(held->inner.get(), -held->nbytes);
  delete held;
}

struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    auto* held = new Held{std::move(inner), static_cast<int64_t>(nbytes)};
    note(data, held->nbytes);
    return c10::DataPtr(data, held, &release, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};
Counting counting;
}  // namespace

void install() {
  if (counting.base != nullptr) return;
  counting.base = c10::GetCPUAllocator();
  main_ = std::this_thread::get_id();
  c10::SetCPUAllocator(&counting, /*priority=*/100);
}
void start() { std::lock_guard<std::mutex> guard(mutex_); log_.clear(); logging_.store(true); }
void mark(int64_t label, bool open) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (logging_.load()) log_.emplace_back(open ? kOpen : kClose, label, 0);
}
std::vector<std::tuple<int64_t, int64_t, int64_t>> stop() {
  logging_.store(false);
  std::lock_guard<std::mutex> guard(mutex_);
  auto out = std::move(log_);
  log_.clear();
  return out;
}
"""
MAIN, OTHER, OPEN, CLOSE = range(4)
_allocator: Any = None
_labels: dict[str, int] = {}


def counting_allocator() -> Any:
    """The counting allocator (compiled once with torch's cpp_extension, then cached), installed in this process."""
    global _allocator
    if _allocator is None:
        from torch.utils.cpp_extension import load_inline

        try:
            _allocator = load_inline(
                "gradsync_bench_counting_allocator",
                cpp_sources=_ALLOCATOR_SOURCE,
                functions=["install", "start", "mark", "stop"],
            )
        except Exception as error:  # noqa: BLE001 - the one-line reason is what the user needs
            raise SystemExit(
                f"zero memory: cannot build the counting CPU allocator (needs a C++ compiler and ninja): {error}"
            ) from error
        _allocator.install()
    return _allocator


@contextmanager
def label(name: str) -> Iterator[None]:
    """A phase of the study (``build``, ``iter2``, ``forward``, ...): marked in the allocation log."""
    key = _labels.setdefault(name, len(_labels))
    if _allocator is not None:
        _allocator.mark(key, True)
    try:
        yield
    finally:
        if _allocator is not None:
            _allocator.mark(key, False)


@dataclass
class Allocation:
    ptr: int
    nbytes: int
    phase: str  # the study's labels open when it was made, outermost first: "iter2 backward"
    where: tuple[str, ...]  # the profiler's enclosing events, innermost first (ops, labels, frames)


@dataclass
class Peak:
    """The high-water mark of live torch allocations in a window, and what was live then."""

    nbytes: int
    at: str  # who made the allocation that reached it (``holder``)
    holders: dict[str, int] = field(default_factory=dict)  # live bytes at the peak, by who allocated them


class AllocationTrace:
    """[Note: model-state memory]
    Opened before the model is built, it logs every allocation and free of torch's CPU allocator
    (``counting_allocator``, a C++ wrapper around it): parameters, ``.grad``, optimizer state,
    reducer buckets, receive buffers, activations and temporaries, in the order they happen, on
    every thread. Replayed, the log gives the live bytes at every instant: the peak is exact, not
    sampled. (The profiler's own memory events are not enough: they see only the profiled thread,
    and a collective's buffer is often freed on gloo's worker thread, which drops the last
    reference; a profile of the training thread alone then counts it live for ever, seen for one
    broadcast in six.) The profiler runs alongside, for names only: each allocation made on the
    training thread is matched, by address and size in order, to the profiler's record of it and
    its enclosing events (gradsync's and torch's ``record_function`` labels, the aten op, and with
    ``with_stack`` the Python frames). Memory outside torch's allocator (gloo's scratch, Python
    objects) is not counted; peak RSS shows it."""

    def __init__(self, with_stack: bool = False) -> None:
        self._allocator = counting_allocator()
        self._profile: Any = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=with_stack)
        self._log: list[tuple[int, int, int]] = []
        self._contexts: dict[tuple[int, int], deque[tuple[str, ...]]] = defaultdict(deque)

    def __enter__(self) -> AllocationTrace:
        self._profile.__enter__()
        self._allocator.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._log = self._allocator.stop()
        self._profile.__exit__(*exc)
        from torch._C._profiler import _ExtraFields_Allocation

        found = []
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            fields = node.extra_fields
            if isinstance(fields, _ExtraFields_Allocation) and fields.alloc_size > 0:
                where, parent = [], node.parent
                while parent is not None:
                    where.append(_name(parent))
                    parent = parent.parent
                found.append((node.start_time_ns, fields.ptr, fields.alloc_size, tuple(where)))
        for _, ptr, nbytes, where in sorted(found):
            self._contexts[(ptr, nbytes)].append(where)
        self._profile = None  # the profiler's records are large; keep only what was read

    def peak(self, window: str | None = None) -> Peak:
        """The peak of live bytes while label ``window`` is open (``iter2``; the whole log if None)."""
        best, best_index = -1, -1
        for index, total, opened, _ in self._replay():
            if (window is None or window in opened) and total > best:
                best, best_index = total, index
        holders: dict[str, int] = defaultdict(int)
        at = ""
        for index, _, _, live in self._replay(stop=best_index):
            if index == best_index:
                at = holder(live[self._log[index][1]])
                for allocation in live.values():
                    holders[holder(allocation)] += allocation.nbytes
        return Peak(best, at, dict(holders))

    def live_at_end(self) -> int:
        return next(iter(deque((total for _, total, _, _ in self._replay()), maxlen=1)), 0)

    def _replay(self, stop: int | None = None) -> Iterator[tuple[int, int, list[str], dict[int, Allocation]]]:
        """After each allocation and free (up to log index ``stop``): (log index, live bytes, open labels, live)."""
        names = {key: name for name, key in _labels.items()}
        contexts = {key: deque(queue) for key, queue in self._contexts.items()}
        live: dict[int, Allocation] = {}
        opened: list[str] = []
        total = 0
        for index, (kind, value, nbytes) in enumerate(self._log[: None if stop is None else stop + 1]):
            if kind == OPEN:
                opened.append(names[value])
            elif kind == CLOSE:
                opened.remove(names[value])
            elif nbytes < 0:
                freed = live.pop(value, None)  # None: made before the log started
                total -= freed.nbytes if freed is not None else 0
                yield index, total, opened, live
            else:
                queue = contexts.get((value, nbytes))
                where = queue.popleft() if kind == MAIN and queue else (("[another thread]",) if kind == OTHER else ())
                live[value] = Allocation(value, nbytes, " ".join(opened), where)
                total += nbytes
                yield index, total, opened, live


def _name(node: Any) -> str:
    try:
        return node.name
    except UnicodeDecodeError:  # seen on some Python-frame events recorded with_stack
        return "[undecodable name]"


def holder(a: Allocation) -> str:
    """Who allocated: the phase (``iter2 backward``), the innermost gradsync frame or label, the aten op."""
    frames = [w for w in a.where if "gradsync/" in w and ".py(" in w]
    labels = [w for w in a.where if not w.startswith(("aten::", "<", "torch/", "[")) and ".py(" not in w]
    op = next((w for w in a.where if w.startswith(("aten::", "[another"))), "")
    inner = frames[0].split("src/", 1)[-1] if frames else (labels[0] if labels else "")
    return " / ".join(part for part in (a.phase, inner, op) if part) or "(no label)"


# ---------------------------------------------------------------------- the analytic lines
def _per_param(fixed: float, sharded: float) -> Callable[[int], float]:
    return lambda n: fixed + sharded / n


# setup -> (formula text, bytes per parameter at N ranks, whether two buckets are added)
ANALYTIC: dict[str, tuple[str, Callable[[int], float], bool]] = {
    "gradsync_ddp": ("20: 4 params + 4 .grad + 4 buckets + 8 Adam", _per_param(20, 0), False),
    "gradsync_ddp_view": ("16: 4 params + 4 .grad (= buckets) + 8 Adam", _per_param(16, 0), False),
    "torch_zero": ("12 + 8/N: 4 params + 4 .grad + 4 buckets + 8/N Adam", _per_param(12, 8), False),
    "zero1_view": ("8 + 8/N (issue #20's target)", _per_param(8, 8), False),
    "zero2_view": ("4 + 12/N + two buckets (issue #20's target)", _per_param(4, 12), True),
    "zero2": ("4 + 12/N + two buckets (issue #20's target)", _per_param(4, 12), True),
    "zero2_backward": (
        "4 + 12/N + two buckets (issue #20's target; it keeps two more in flight)",
        _per_param(4, 12),
        True,
    ),
    "fsdp2": (
        "4 + 16/N: unsharded params kept + 4/N params + 4/N grads + 8/N Adam (each layer's unsharded params are "
        "freed in its backward, where its gradient shard appears, so 4 + 12/N is reachable)",
        _per_param(4, 16),
        False,
    ),
}


def analytic_bytes(name: str, world: int, params: int, buckets: list[int]) -> float | None:
    if name not in ANALYTIC:
        return None
    _, per_param, with_buckets = ANALYTIC[name]
    extra = sum(sorted(buckets)[-2:]) if with_buckets else 0
    return per_param(world) * params + extra
