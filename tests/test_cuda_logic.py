"""The CUDA-only logic, exercised on CPU with fake streams and events.

``StreamOrder`` (engine/streams.py) and ``CudaClock`` (observability/cuda_clock.py) take their
``current_stream``/event factories as arguments, so what they decide (which streams a launch waits
for; when events are read and what they turn into) is tested here without a GPU. The real thing runs
in tests/gpu/ wherever CUDA is.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from emulated_group import EmulatedGroup
from gradsync import DistributedDataParallel as DDP
from gradsync.cuda.current_stream import KNOWN_STREAMS_MAX, CurrentStream
from gradsync.engine.streams import StreamOrder, stream_order_for
from gradsync.observability.cuda_clock import (
    FULL_PASS_EVERY,
    FULL_PASSES_FIRST,
    MAX_PENDING,
    CudaClock,
    cuda_clock_for,
)
from gradsync.observability.timing import IterationTimes, RunningStats
from gradsync.wrapper.device import move_to_device, tensor_to_device
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import MLP, global_batch, grads_of, loss_fn, rank_world, reference_step, shard

CPU = torch.device("cpu")


class FakeStream:
    """A stream that remembers what it waited for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.name)

    def __repr__(self) -> str:
        return self.name


class Streams:
    """``current_stream`` for the code under test: whichever stream the test made current."""

    def __init__(self) -> None:
        self.by_name = {name: FakeStream(name) for name in ("default", "side1", "side2")}
        self.current = self.by_name["default"]

    def use(self, name: str) -> None:
        self.current = self.by_name[name]

    def __call__(self, device: torch.device) -> FakeStream:
        return self.current


class FakeEvent:
    """An event whose 'GPU time' is the host's at record; it has run once ``done`` (or synchronised)."""

    done_by_default = True

    def __init__(self) -> None:
        self.t: float | None = None
        self.done = FakeEvent.done_by_default
        self.synchronized = False

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.synchronized = True

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.t is not None and other.t is not None, "elapsed_time of an event never recorded"
        return (other.t - self.t) * 1e3


# ---------------------------------------------------------------------------- StreamOrder
def test_one_stream_waits_for_nothing() -> None:
    streams = Streams()
    order = StreamOrder(CPU, streams)
    order.begin_pass([0, 0, 1], 2)
    for index in (2, 1, 0):
        order.note(index)
    order.wait_for_producers(1)
    order.wait_for_producers(0)
    assert order.waits == 0 and streams.current.waited == []


def test_launch_waits_for_every_other_producer_of_its_bucket_only() -> None:
    streams = Streams()
    order = StreamOrder(CPU, streams)
    order.begin_pass([0, 0, 0, 1], 2)  # parameters 0-2 in bucket 0, parameter 3 in bucket 1
    streams.use("side1")
    order.note(3)  # bucket 1: side1 only
    order.note(0)
    streams.use("side2")
    order.note(1)
    order.note(1)  # a second accumulation on the same stream is noted once
    streams.use("default")
    order.note(2)  # completes bucket 0 on the default stream: its launch runs there
    order.wait_for_producers(0)
    assert streams.by_name["default"].waited == ["side1", "side2"]
    streams.use("side1")
    order.wait_for_producers(1)  # launched from side1, produced on side1: nothing to wait for
    assert streams.by_name["side1"].waited == [] and order.waits == 2
    order.begin_pass([0, 0, 0, 1], 2)  # a new backward forgets the last one's streams
    streams.use("default")
    order.wait_for_producers(0)
    assert order.waits == 2


def test_current_stream_keys_each_stream_and_keeps_a_bounded_cache() -> None:
    streams = Streams()
    current = CurrentStream(CPU, streams)
    assert current.key() is streams.by_name["default"] and current.stream() is streams.by_name["default"]
    streams.use("side1")
    key = current.key()
    assert key is streams.by_name["side1"] and current.stream(key) is streams.by_name["side1"]
    for n in range(2 * KNOWN_STREAMS_MAX):  # many short-lived streams: the cache starts over, never grows past its cap
        streams.current = FakeStream(f"s{n}")
        assert current.stream() is streams.current
        assert len(current._known) <= KNOWN_STREAMS_MAX


def test_nothing_cuda_on_cpu() -> None:
    assert stream_order_for(CPU) is None and cuda_clock_for(CPU) is None
    x = torch.randn(3)
    assert tensor_to_device(x, CPU) is x
    moved = move_to_device({"a": [x, (x,)]}, CPU)
    assert moved["a"][0] is x and moved["a"][1][0] is x


# ---------------------------------------------------------------------------- CudaClock
class Future:
    """A future that completes when told to, running its callbacks then."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:  # noqa: ANN001
        self.callbacks.append(callback)

    def complete(self) -> None:
        for callback in self.callbacks:
            callback(self)


def _clock() -> tuple[CudaClock, Streams]:
    streams = Streams()
    return CudaClock(CPU, new_event=FakeEvent, current_stream=streams, capturing=lambda: False), streams


def _one_pass(clock: CudaClock, delivered: list, buckets: int = 2, complete: bool = True) -> list[Future]:
    clock.forward_started()
    time.sleep(0.001)
    clock.forward_ended()
    clock.begin_pass(buckets)
    clock.backward_started()
    futures = []
    for b in range(buckets):
        time.sleep(0.001)
        clock.launched(b)
        future = Future()
        clock.watch(b, future)
        futures.append(future)
    clock.finalize_started()
    if complete:
        time.sleep(0.002)
        for future in futures:
            future.complete()
    times = IterationTimes(buckets)
    times.bucket_ready = [123.0] * buckets  # a host value the GPU figures replace
    clock.finished(times, delivered.append)
    return futures


def test_clock_resolves_events_in_order_of_the_gpu() -> None:
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    _one_pass(clock, delivered)
    assert len(delivered) == 1 and clock.pending == 0
    times = delivered[0]
    assert times.forward_start < times.forward_end <= times.backward_start
    assert times.backward_start < times.bucket_launch[0] < times.bucket_launch[1] < times.finalize_start
    assert times.finalize_start < min(times.bucket_done) and times.reductions_done == max(times.bucket_done)
    assert times.reductions_done <= times.finalize_end and times.bucket_ready == [0.0, 0.0]
    # on the host clock's axis (the anchor maps events onto perf_counter)
    assert abs(times.finalize_end - time.perf_counter()) < 1.0
    assert times.comm_s > 0 and times.exposed_comm_s > 0


def test_clock_waits_for_the_gpu_without_blocking() -> None:
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    FakeEvent.done_by_default = False
    try:
        _one_pass(clock, delivered)
        assert delivered == [] and clock.pending == 1  # not run yet: kept, nothing waited for
        for events, _, _ in clock._pending:
            for event in events.recorded():
                event.done = True
        clock.collect()
        assert len(delivered) == 1 and clock.pending == 0
    finally:
        FakeEvent.done_by_default = True


def test_clock_waits_for_the_oldest_only_when_far_behind() -> None:
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    FakeEvent.done_by_default = False
    try:
        for _ in range(MAX_PENDING):
            _one_pass(clock, delivered)
        assert delivered == [] and clock.pending == MAX_PENDING
        _one_pass(clock, delivered)  # one more than may be outstanding: the oldest is waited for
        assert len(delivered) == 1 and clock.pending == MAX_PENDING
        clock.collect(wait=True)
        assert len(delivered) == MAX_PENDING + 1 and clock.pending == 0
    finally:
        FakeEvent.done_by_default = True


def test_clock_waits_for_a_bucket_that_has_not_reported() -> None:
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    futures = _one_pass(clock, delivered, complete=False)
    assert delivered == []  # a completion callback still to come (gloo runs it on its own thread)
    for future in futures:
        future.complete()
    clock.collect()
    assert len(delivered) == 1 and all(delivered[0].bucket_done)


def _watch_every_kind_of_pending() -> bool:
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    clock.forward_started()
    clock.forward_ended()
    clock.begin_pass(3)
    clock.backward_started()

    class CarriesWork:  # what a reduce-scatter leaves in flight (collectives/sharded.py's PendingReduceScatter)
        def __init__(self, work: object) -> None:
            self.work = work

    work = dist.all_reduce(torch.ones(1), async_op=True)
    hook_future = Future()
    for b, pending in enumerate((work, hook_future, CarriesWork(work))):
        clock.launched(b)
        clock.watch(b, pending)
    clock.watch(0, object())  # nothing to watch: ignored, not an error
    hook_future.complete()
    work.wait()
    clock.finalize_started()
    clock.finished(IterationTimes(3), delivered.append)
    clock.collect(wait=True)
    return len(delivered) == 1 and all(delivered[0].bucket_done)


def test_clock_finds_the_future_of_every_kind_of_pending_reduction() -> None:
    assert run_distributed(_watch_every_kind_of_pending, 1) == [True]


def test_clock_samples_bucket_completions_but_times_the_last_bucket_every_pass() -> None:
    """[Note: sampled bucket completions]: every bucket on the first passes and one pass in
    FULL_PASS_EVERY; otherwise the last bucket only, which still gives the communication window."""
    clock, _ = _clock()
    delivered: list[IterationTimes] = []
    passes = FULL_PASS_EVERY + 2  # 0 .. FULL_PASS_EVERY + 1: sampled passes 0-7 and 32
    for _ in range(passes):
        _one_pass(clock, delivered, buckets=3)
    assert len(delivered) == passes
    every_bucket = {n for n in range(passes) if n < FULL_PASSES_FIRST or n % FULL_PASS_EVERY == 0}
    assert FULL_PASSES_FIRST in range(passes) and FULL_PASSES_FIRST not in every_bucket  # sampling happens
    for n, times in enumerate(delivered):
        assert times.bucket_done[2] > times.bucket_launch[2] > 0, f"pass {n}: the last bucket is always timed"
        assert times.reductions_done == times.bucket_done[2] and times.comm_s > 0, f"pass {n}"
        if n in every_bucket:
            assert all(times.bucket_done) and times.bucket_untimed == [], f"pass {n}"
        else:
            assert times.bucket_done[:2] == [0.0, 0.0] and times.bucket_untimed == [0, 1], f"pass {n}"
    running = RunningStats()
    for times in delivered:
        running.add(times, 0, ())
    assert running.bucket_launches == [passes] * 3  # every completed reduction counts
    assert running.bucket_timed == [len(every_bucket), len(every_bucket), passes]
    sampled = [t.bucket_done[0] - t.bucket_launch[0] for n, t in enumerate(delivered) if n in every_bucket]
    assert abs(running.average_reduce_s(0) - sum(sampled) / len(sampled)) < 1e-12  # over the timed ones only


def test_clock_times_every_bucket_while_a_timeline_is_traced() -> None:
    clock, _ = _clock()
    clock.every_bucket_always = True
    delivered: list[IterationTimes] = []
    for _ in range(FULL_PASSES_FIRST + 2):
        _one_pass(clock, delivered, buckets=3)
    assert all(all(times.bucket_done) and not times.bucket_untimed for times in delivered)


def test_captured_pass_keeps_host_times() -> None:
    streams = Streams()
    clock = CudaClock(CPU, new_event=FakeEvent, current_stream=streams, capturing=lambda: True)
    delivered: list[IterationTimes] = []
    _one_pass(clock, delivered)
    assert len(delivered) == 1 and delivered[0].bucket_ready == [123.0, 123.0]


# ---------------------------------------------------------------------------- in the reducer
def _train_with_fakes() -> dict:
    """Two gloo ranks on CPU with the reducer's CUDA side switched on over fakes."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=1000 / 2**20)  # 5 buckets (see test_observability)
    streams = Streams()
    engine = ddp.engine
    engine.streams = StreamOrder(CPU, streams)
    engine.records.clock = CudaClock(CPU, new_event=FakeEvent, current_stream=streams, capturing=lambda: False)
    # Alternate the 'current stream' between the two side streams at every tensor of the backward:
    # parameters of one bucket are then produced on both.
    flip = {"n": 0}

    def alternate(grad: torch.Tensor) -> None:
        flip["n"] += 1
        streams.use("side1" if flip["n"] % 2 else "side2")

    for layer in model.layers:  # runs before the weight's gradient is accumulated, so before its hook
        layer[0].weight.register_hook(alternate)
        layer[0].bias.register_hook(alternate)
    steps = 3
    for step in range(steps):
        x, y = global_batch("mlp", world, step)
        ddp.zero_grad()
        reference.zero_grad()
        loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
        streams.use("default")
        reference_step(reference, x, y, world)
        for name, grad in grads_of(model).items():
            assert torch.allclose(grad, grads_of(reference)[name], atol=1e-6), name
    stats = ddp.stats()
    waited = {name: list(s.waited) for name, s in streams.by_name.items()}
    return {"waits": engine.streams.waits, "waited": waited, "stats": stats.as_dict()}


def test_reducer_waits_and_times_through_its_cuda_side() -> None:
    for result in run_distributed(_train_with_fakes, 2):
        assert result["waits"] > 0, "buckets whose gradients came from two streams waited for them"
        waited_for = {s for names in result["waited"].values() for s in names}
        assert waited_for <= {"side1", "side2", "default"} and waited_for
        stats = result["stats"]
        assert stats["timing"] == "CUDA events" and stats["iterations"] == 3
        assert stats["avg_backward_s"] > 0 and stats["avg_comm_s"] > 0
        assert all(b["launches"] >= 1 for b in stats["buckets"])


def _timing_of_cpu_wrapper() -> str:
    ddp = DDP(MLP())
    assert ddp.engine.streams is None and ddp.engine.records.clock is None
    return ddp.stats().timing


def test_cpu_reducer_has_no_cuda_side_and_says_host_clock() -> None:
    assert run_distributed(_timing_of_cpu_wrapper, 2) == ["host clock", "host clock"]


# ---------------------------------------------------------------------------- the emulated group
def _emulated_group_parity() -> dict[str, list[str]]:
    """Both DDPs over ``EmulatedGroup`` (two identical ranks) give the local gradients bitwise."""
    calls = {}
    for name in ("gradsync", "torch"):
        group = EmulatedGroup(2)
        group.register()
        try:
            torch.manual_seed(0)
            model, reference = MLP(), MLP()
            reference.load_state_dict(model.state_dict())
            wrapper = DDP if name == "gradsync" else TorchDDP
            ddp = wrapper(model, process_group=group, init_sync=False, gradient_as_bucket_view=True)
            for step in range(3):  # the third runs on gradsync's rebuilt buckets
                x, y = global_batch("mlp", 1, step)
                model.zero_grad()
                reference.zero_grad()
                loss_fn(ddp(x), y).backward()
                loss_fn(reference(x), y).backward()
                for (param_name, p), q in zip(model.named_parameters(), reference.parameters()):
                    assert torch.equal(p.grad, q.grad), f"{name}: {param_name} differs from the local gradient"
            calls[name] = sorted(set(group.calls))
        finally:
            group.unregister()
    return calls


def test_emulated_group_gives_local_gradients_to_both_ddps_on_cpu() -> None:
    calls = run_distributed(_emulated_group_parity, 1)[0]
    assert "allreduce" in calls["gradsync"] and "allreduce" in calls["torch"]


def _sharded_with_fakes(stage: int) -> float:
    """A sharded optimizer's reduce-scatter launched and timed through the CUDA side (fakes) trains as without."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model, reference = MLP(), MLP()
    reference.load_state_dict(model.state_dict())
    results = []
    for net, fake in ((model, True), (reference, False)):
        ddp = DDP(net, bucket_cap_mb=1000 / 2**20)
        if fake:
            streams = Streams()
            ddp.engine.streams = StreamOrder(CPU, streams)
            clock = CudaClock(CPU, new_event=FakeEvent, current_stream=streams, capturing=lambda: False)
            ddp.engine.records.clock = clock
        optimizer = ShardedOptimizer(ddp, torch.optim.SGD, stage=stage, lr=0.1)
        for step in range(3):
            x, y = global_batch("mlp", world, step)
            optimizer.zero_grad()
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            optimizer.step()
        results.append(ddp.stats())
    assert results[0].timing == "CUDA events" and results[0].iterations == 3
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def test_sharded_optimizer_through_the_cuda_side() -> None:
    for stage in (1, 2):
        assert max(run_distributed(_sharded_with_fakes, 2, stage)) == 0.0
