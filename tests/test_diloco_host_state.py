"""DiLoCo's outer state on the host (issue #45), its GPU code path run on CPU with fake streams.

tests/fake_staging.py's kit makes a CPU "device" take the path a CUDA model takes
([Note: the outer state off the GPU] in gradsync/diloco/host_state.py): the staging copies, the
side stream, the events, the exchange's wait on its own thread. Its streams check every read
against the last write, so these tests see which stream each copy runs on, which waits are
recorded, that the training thread never synchronises with ``delay > 0``, and (negative controls)
that a missing wait is caught. The values are compared bitwise with the CPU path (which
tests/test_diloco*.py hold against the one-process simulation) and within 1e-5 with that simulation
itself. tests/gpu/test_diloco_gpu.py does the same on a real GPU.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync.diloco as diloco
import gradsync.diloco.host_state as host_state
from fake_staging import FakeKit, install, name_buffers
from gradsync.diloco.exchange import OuterExchange
from test_diloco import mlp_batch, params_relative, relative, simulate, train_replica

from harness import run_distributed
from models import make_model, rank_world

pytestmark = pytest.mark.timeout(90)

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _build(mode: str, H: int, F: int, delay: int, merge: str, kit: FakeKit | None = None) -> tuple[nn.Module, Any]:
    """``mode``: "cpu" (no kit: today's path), "host" or "device" (the GPU's placements, through ``kit``)."""
    model = make_model("mlp")
    before = install(kit or FakeKit()) if mode != "cpu" else None
    try:
        state = "device" if mode == "device" else "host"
        outer = diloco.DiLoCo(
            model, ADAMW(model.parameters()), H, fragments=F, delay=delay, merge=merge, outer_state=state
        )
    finally:
        if before is not None:
            host_state.kit_for = before
    return model, outer


def _flat_state(outer: Any) -> list[torch.Tensor]:
    tensors = [theta.detach().clone() for theta in outer.global_parameters]
    for state in outer.outer_optimizer.state_dict()["state"].values():
        tensors += [t.clone() for t in state.values() if torch.is_tensor(t)]
    return tensors


# -- the stream order --------------------------------------------------------------------------------


def _one_round(delay: int) -> list[tuple[str, str, str]]:
    kit = FakeKit()
    model, outer = _build("host", 4, 2, delay, "mix", kit)
    name_buffers(kit, outer)
    assert outer.placement is not None and outer.placement.on_host
    assert all(theta.device.type == "cpu" for theta in outer.global_parameters)
    train_replica(model, outer, range(4 + delay))
    outer.close()
    return kit.log


@pytest.mark.parametrize("delay", [0, 1])
def test_each_copy_runs_on_its_stream_after_the_waits_it_needs(delay: int) -> None:
    for log in run_distributed(_one_round, 2, delay):
        side = [what for where, what, _ in log if where == "side" and not what.startswith("waits")]
        current = [what for where, what, _ in log if where == "current" and not what.startswith("waits")]
        # Two fragments, each once: down from the staging buffer, up from its theta, on the side stream only.
        assert side == ["['gpu'] -> ['down']", "['theta0'] -> ['gpu']", "['gpu'] -> ['down']", "['theta1'] -> ['gpu']"]
        # The current stream gathers the parameters into the staging buffer and merges them back; nothing else.
        assert current and all(what in ("['param'] -> ['gpu']", "['gpu'] -> ['param']", "['gpu', 'param'] -> ['gpu']")
                               for what in current)  # fmt: skip
        on_side = [what for where, what, _ in log if where == "side"]
        for i, what in enumerate(on_side):  # each copy on the side stream right after it waited for the current
            if not what.startswith("waits"):
                assert i > 0 and on_side[i - 1].startswith("waits current@"), on_side
        # each copy up is waited for by the current stream, each copy down before the staging buffer is reused
        assert sum(where == "current" and what.startswith("waits side") for where, what, _ in log) >= 3
        syncs = [thread for where, what, thread in log if where == "host"]
        assert len(syncs) == 2, "one synchronisation per fragment's copy to the host"
        if delay > 0:  # the exchange's thread waits for the copy, never the training thread
            assert all(thread.startswith("gradsync-diloco") for thread in syncs), syncs
        else:  # delay 0: the outer step blocks the training loop anyway; the exchange runs there
            assert all(thread == "MainThread" for thread in syncs), syncs


def _without(drop: str) -> None:
    model, outer = _build("host", 2, 1, 0, "mix", FakeKit(drop_waits_of=(drop,)))
    train_replica(model, outer, range(4))


@pytest.mark.parametrize("drop", ["side", "current"])
def test_a_missing_wait_is_caught_negative_control(drop: str) -> None:
    # "side": the copy down would read the staging buffer before the gather wrote it; "current": the merge
    # would read it before the copy up wrote it (and the next gather write it while the copy down reads it).
    with pytest.raises(Exception, match="MissingWait|before .* finished writing it|may still read it"):
        run_distributed(_without, 2, drop)


def _host_reads_unsynchronised() -> None:
    kit = FakeKit()
    model, outer = _build("host", 2, 1, 0, "mix", kit)
    name_buffers(kit, outer)
    outer.placement.staging.kit.host_seen = _Forgetful()  # synchronisations are not remembered
    train_replica(model, outer, range(2))


class _Forgetful(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: object, value: object) -> None:
        pass


def test_the_host_reading_before_the_copy_is_caught_negative_control() -> None:
    with pytest.raises(Exception, match="the host reads down before side finished writing it"):
        run_distributed(_host_reads_unsynchronised, 2)


# -- the values ----------------------------------------------------------------------------------------


class _Foreign:
    """An exchange DiLoCo does not know (as gradsync.elastic_diloco's): it is handed tensors, on the training
    thread."""

    def __init__(self, inner: OuterExchange) -> None:
        self.inner = inner
        self.count = inner.count
        self.seen: list[type] = []

    def start(self, delta: Any, flags: Any = None, residuals: Any = None) -> Any:
        self.seen.append(type(delta))
        return self.inner.start(delta, flags, residuals)

    def finished(self) -> None:
        self.inner.finished()

    def close(self) -> None:
        self.inner.close()


def _modes_against_each_other(H: int, F: int, delay: int, merge: str, foreign: bool) -> float:
    rank, world = rank_world()
    steps = 3 * H + 1
    finals = {}
    for mode in ("cpu", "host", "device"):
        model, outer = _build(mode, H, F, delay, merge)
        if foreign and mode == "host":
            wrapper = _Foreign(OuterExchange(outer.topology, outer.wire_format, overlap=delay > 0))
            outer.exchange.close()
            outer.exchange = wrapper
        train_replica(model, outer, range(steps))
        outer.close()
        finals[mode] = [p.detach().clone() for p in model.parameters()] + _flat_state(outer)
        if foreign and mode == "host":
            assert wrapper.seen and all(kind is torch.Tensor for kind in wrapper.seen)
    for mode in ("host", "device"):
        for i, (a, b) in enumerate(zip(finals[mode], finals["cpu"])):
            assert torch.equal(a, b), f"rank {rank}: {mode} mode's tensor {i} differs from the CPU path's"
    replicas = [make_model("mlp") for _ in range(world)]
    batch = functools.partial(mlp_batch, world)
    simulated, _ = simulate(replicas, ADAMW, diloco.nesterov, batch, steps, H, F, delay, 0.5, merge=merge)
    ours = finals["host"][: len(list(simulated[rank].parameters()))]
    return max(relative(p, q.detach()) for p, q in zip(ours, simulated[rank].parameters()))


@pytest.mark.parametrize(
    "H,F,delay,merge,foreign",
    [(4, 1, 0, "mix", False), (4, 2, 1, "mix", False), (6, 2, 2, "keep_inner_steps", False), (4, 2, 1, "mix", True)],
    ids=["diloco", "streaming", "streaming-keep", "streaming-foreign-exchange"],
)
def test_host_and_device_placements_are_bitwise_the_cpu_path(
    H: int, F: int, delay: int, merge: str, foreign: bool
) -> None:
    assert max(run_distributed(_modes_against_each_other, 2, H, F, delay, merge, foreign)) < 1e-5


# -- healing and checkpoints with the state on the host ---------------------------------------------


def _healed_from_a_peer(at: int) -> None:
    """A replica healed as FaultTolerantDiLoCo heals one (model, inner optimizer, DiLoCo's state_dict) at
    inner step ``at`` ends bitwise where the one that never stopped ends; with delay 1 and ``at`` even an
    exchange is on its way (the checkpoint holds it)."""
    rank, _ = rank_world()
    H, F, delay, steps = 4, 2, 1, 13
    model, outer = _build("host", H, F, delay, "mix")
    train_replica(model, outer, range(at))
    assert (outer._in_flight is not None) == (at % 2 == 0)
    saved = copy.deepcopy({"model": model.state_dict(), "inner": outer.inner.state_dict(), "outer": outer.state_dict()})
    train_replica(model, outer, range(at, steps))
    outer.close()
    healed, again = _build("host", H, F, delay, "mix")
    healed.load_state_dict(saved["model"])
    again.inner.load_state_dict(saved["inner"])
    again.load_state_dict(saved["outer"])
    assert all(theta.device.type == "cpu" for theta in again.global_parameters)
    train_replica(healed, again, range(at, steps))
    again.close()
    for name, a, b in zip([n for n, _ in model.named_parameters()], model.parameters(), healed.parameters()):
        assert torch.equal(a, b), f"rank {rank}: {name} after the heal at step {at}"
    for i, (a, b) in enumerate(zip(_flat_state(outer), _flat_state(again))):
        assert torch.equal(a, b), f"rank {rank}: outer state {i} after the heal at step {at}"
    assert params_relative(model, healed) == 0.0


@pytest.mark.parametrize("at", [4, 5], ids=["exchange-in-flight", "after-a-landing"])
def test_a_replica_healed_from_the_host_state_goes_on_bitwise(at: int) -> None:
    run_distributed(_healed_from_a_peer, 2, at)


def _build_with(outer_state: str) -> bool:
    model = make_model("mlp")
    outer = diloco.DiLoCo(model, ADAMW(model.parameters()), 4, outer_state=outer_state)
    unplaced = outer.placement is None and dist.get_backend(outer.topology.outer) == "gloo"
    outer.close()
    return unplaced


def test_outer_state_is_checked_by_name() -> None:
    with pytest.raises(Exception, match="outer_state must be one of \\('host', 'device'\\)"):
        run_distributed(_build_with, 2, "gpu")


@pytest.mark.parametrize("outer_state", ["host", "device"])
def test_on_cpu_nothing_is_staged(outer_state: str) -> None:
    assert run_distributed(_build_with, 2, outer_state) == [True, True]
