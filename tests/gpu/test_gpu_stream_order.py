"""Stream order on a real GPU, through a slow emulated world of two ([Note: the slow emulated group]).

Two identical ranks emulated in this process; the all-reduce runs on a private stream that sleeps
before it writes. Any read of a result before the reduction ended, any copy-in before a gradient was
written, and any copy back on a stream that did not wait, gives a wrong value on every run, so each
case compares ``.grad`` bitwise with a local backward. torch's DDP on the same group is the control:
where it matches, the emulation is sound; where gradsync must differ from torch (two branches on two
side streams) the control's outcome is reported, not asserted. Turning gradsync's stream order off
must break the two-branch case wherever a launch would have waited for another stream: that shows the
test can see the race at all. (If every hook ran on one stream, as when the parameters' AccumulateGrad
nodes are held, no launch would have another stream to wait for, and that test skips saying so:
[Note: stream order] in engine/streams.py.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_models import CUDA, NO_CUDA, TwoBranches, assert_same_grads, batch, forward_kwargs, model_and_reference
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from emulated_group import EmulatedGroup
from gradsync import DistributedDataParallel as DDP
from gradsync import hooks
from gradsync.engine.streams import StreamOrder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

CONTROL: dict[str, object] = {}  # torch DDP's outcome per case and gradsync's waits, to $GRADSYNC_GPU_OUT if set


@pytest.fixture
def group(nccl_world) -> EmulatedGroup:  # noqa: ANN001
    group = EmulatedGroup(2)
    group.register()
    yield group
    torch.cuda.synchronize()
    group.unregister()


def _wrap(kind: str, model: torch.nn.Module, group: EmulatedGroup, **options) -> torch.nn.Module:  # noqa: ANN003
    if kind == "gradsync":
        return DDP(model, process_group=group, init_sync=False, **options)
    return TorchDDP(model, process_group=group, init_sync=False, **options)


def _steps(ddp, model, reference, name: str, what: str, steps: int = 3, stream=None, kwargs_of=None) -> None:  # noqa: ANN001
    """Synced steps through ``ddp`` (inside ``stream`` if given) against local steps; bitwise after each."""
    for step in range(steps):
        x, y = batch(name, step)
        kwargs = kwargs_of(step) if kwargs_of else {}
        model.zero_grad(set_to_none=step % 2 == 0)
        reference.zero_grad(set_to_none=step % 2 == 0)
        if stream is None:
            F.mse_loss(ddp(x, **kwargs), y).backward()
        else:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                F.mse_loss(ddp(x, **kwargs), y).backward()
            torch.cuda.current_stream().wait_stream(stream)
        F.mse_loss(reference(x, **kwargs), y).backward()
        assert_same_grads(model, reference, f"{what}, step {step}")


def _control(case: str, run) -> None:  # noqa: ANN001
    """torch's DDP on the same case: its outcome is reported (GRADSYNC_GPU_OUT), not asserted."""
    try:
        run()
        _record(f"torch DDP, {case}", "matches the local backward")
    except Exception as error:  # noqa: BLE001 - the control's outcome, whatever it is
        _record(f"torch DDP, {case}", f"{type(error).__name__}: {str(error)[:200]}")


def _record(key: str, value: object) -> None:
    CONTROL[key] = value
    out = os.environ.get("GRADSYNC_GPU_OUT")
    if out:
        with open(os.path.join(out, "torch_ddp_control.json"), "w") as f:
            json.dump(CONTROL, f, indent=1, default=str)


@pytest.mark.parametrize("kind", ["gradsync", "torch"])
@pytest.mark.parametrize("as_view", [False, True])
def test_default_stream(group, kind: str, as_view: bool) -> None:
    model, reference = model_and_reference("mlp")
    ddp = _wrap(kind, model, group, gradient_as_bucket_view=as_view, bucket_cap_mb=0.004)
    _steps(ddp, model, reference, "mlp", f"{kind} default stream as_view={as_view}")
    assert group.calls.count("allreduce") >= 3


@pytest.mark.parametrize("kind", ["gradsync", "torch"])
def test_forward_and_backward_on_a_side_stream(group, kind: str) -> None:
    """Wrapped on the default stream, trained inside torch.cuda.stream(s) (torch's non_default_stream test)."""
    model, reference = model_and_reference("mlp")
    ddp = _wrap(kind, model, group, bucket_cap_mb=0.004)
    _steps(ddp, model, reference, "mlp", f"{kind} side stream", stream=torch.cuda.Stream())


@pytest.mark.parametrize("find_unused,static", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("as_view", [False, True])
def test_unused_parameters_and_static_graph(group, find_unused: bool, static: bool, as_view: bool) -> None:
    model, reference = model_and_reference("unused")
    options = {"find_unused_parameters": find_unused, "static_graph": static, "gradient_as_bucket_view": as_view}
    ddp = _wrap("gradsync", model, group, bucket_cap_mb=0.004, **options)
    kwargs_of = None if static else (lambda step: forward_kwargs("unused", step))
    _steps(ddp, model, reference, "unused", f"gradsync {options}", steps=4, kwargs_of=kwargs_of)


def _divided_then_cast(dtype: torch.dtype):  # noqa: ANN202
    """gradsync's cast hooks divide in the gradient's precision, then cast; the emulated sum doubles exactly."""
    return lambda g: ((g / 2).to(dtype) * 2).to(g.dtype)


def _cast_then_divided(dtype: torch.dtype):  # noqa: ANN202
    """torch's cast hooks cast, then divide in the low precision."""
    return lambda g: ((g.to(dtype) / 2) * 2).to(g.dtype)


# name -> (state from the group, hook, what the local gradient becomes through it)
HOOKS = {
    "gradsync allreduce": (hooks.AllReduceState, hooks.allreduce_hook, None),
    "gradsync fp16": (hooks.AllReduceState, hooks.fp16_compress_hook, _divided_then_cast(torch.float16)),
    "gradsync bf16": (hooks.AllReduceState, hooks.bf16_compress_hook, _divided_then_cast(torch.bfloat16)),
    "torch allreduce": (lambda g: g, default_hooks.allreduce_hook, None),
    "torch fp16": (lambda g: g, default_hooks.fp16_compress_hook, _cast_then_divided(torch.float16)),
}


def _then_chain_hook(group: dist.ProcessGroup, bucket) -> torch.futures.Future:  # noqa: ANN001
    """A user's hook: sum, then divide in a .then callback (torch runs it on streams synced with the sum)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].div_(group.size()))


@pytest.mark.parametrize("name", [*HOOKS, "then chain"])
@pytest.mark.parametrize("as_view", [False, True])
def test_comm_hooks(group, name: str, as_view: bool) -> None:
    model, reference = model_and_reference("mlp")
    ddp = _wrap("gradsync", model, group, gradient_as_bucket_view=as_view, bucket_cap_mb=0.004)
    if name == "then chain":
        state, hook, rounded = group, _then_chain_hook, None
    else:
        make_state, hook, rounded = HOOKS[name]
        state = make_state(group)
    ddp.register_comm_hook(state, hook)
    for step in range(3):
        x, y = batch("mlp", step)
        model.zero_grad()
        reference.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        assert_same_grads(model, reference, f"hook {name} as_view={as_view} step {step}", rounded)


def _two_branches(kind: str, slow: str, group: EmulatedGroup, stream_order: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TwoBranches(slow).to(CUDA)
    reference = TwoBranches(slow).to(CUDA)
    reference.load_state_dict(model.state_dict())
    ddp = _wrap(kind, model, group)
    if not stream_order:
        ddp.engine.streams = _NoWaits(CUDA)
    _steps(ddp, model, reference, "two_branches", f"{kind} two branches, slow {slow}", steps=3)
    return ddp


class _NoWaits(StreamOrder):
    """gradsync with its stream order switched off: counts the waits it would have made, makes none."""

    def wait_for_producers(self, b: int) -> None:
        self.waits += len(self.other_producers(b))


@pytest.mark.parametrize("slow", ["a", "b"])
def test_two_branches_on_two_side_streams(group, slow: str) -> None:
    """The two-side-streams case (DeepSpeed #8061): one bucket, gradients from two streams, one of them late."""
    ddp = _two_branches("gradsync", slow, group)
    _control(f"two branches, slow {slow}", lambda: _two_branches("torch", slow, group))
    _record(f"gradsync stream waits, two branches, slow {slow}", ddp.engine.streams.waits)


def test_the_race_is_visible_without_stream_order(group) -> None:
    """Without the waits, a launch that should have waited for another stream reads a gradient too early."""
    outcomes, would_wait = {}, 0
    for slow in ("a", "b"):
        try:
            ddp = _two_branches("gradsync", slow, group, stream_order=False)
            outcomes[slow] = "correct"
            would_wait += ddp.engine.streams.waits
        except AssertionError as error:
            outcomes[slow] = str(error)[:160]
            would_wait += 1
    _record("without stream order", outcomes)
    if would_wait == 0:
        pytest.skip(
            "every gradient hook ran on one stream, so no launch had another stream to wait for (held "
            "AccumulateGrad nodes keep the stream they were made on, and autograd orders each gradient "
            "before its hook: [Note: stream order])"
        )
    assert any(o != "correct" for o in outcomes.values()), (
        f"with the stream waits off every case still matched ({outcomes}) although launches would have "
        f"waited {would_wait} times: this test cannot see the race"
    )
