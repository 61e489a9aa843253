"""A rank killed mid-step: the survivors raise a clear error, within the timeout, naming it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed
from models import MLP, ConvBN, global_batch, loss_fn, rank_world, shard

VICTIM = 1
# A survivor blocked on a live peer only notices at the group's timeout: keep it short.
PG_TIMEOUT_S = 10


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class DiesInForward(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, at_call: int) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.at_call = at_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call and torch.distributed.get_rank() == VICTIM:
            _die()
        return self.inner(x)


def _kill_during(phase: str) -> str:
    rank, world = rank_world()
    torch.manual_seed(0)
    if phase == "forward":
        model, name = DiesInForward(ConvBN(), at_call=3), "cnn_bn"
    elif phase == "between_steps":
        model, name = ConvBN(), "cnn_bn"
    else:
        model, name = MLP(), "mlp"
    ddp = DDP(model)
    if phase == "backward" and rank == VICTIM:
        calls = {"n": 0}

        def die_on_third_backward(grad: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 3:
                _die()
            return grad

        model.head.weight.register_hook(die_on_third_backward)
    if phase == "reduction":

        def die_in_reduction(state, bucket):  # noqa: ANN001 - torch checks hook annotations
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            if ddp.engine.iteration == 2 and rank == VICTIM:
                _die()
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, die_in_reduction)
    with pytest.raises(RuntimeError) as error:
        for step in range(5):
            if phase == "between_steps" and step == 2 and rank == VICTIM:
                _die()
            x, y = global_batch(name, world, step)
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    return str(error.value)


BROADCAST = "the buffer broadcast before forward of iteration 2"
REDUCTION = "the wait for gradient reductions at the end of backward of iteration 2"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "phase, where",
    [
        # killed inside forward: the others finish their forward and fail in the reduction
        ("forward", {0: {REDUCTION}, 2: {REDUCTION}}),
        # killed between steps: rank 0, the broadcast's source, fails sending buffers to the
        # dead rank; rank 2 may already have its copy (gloo's broadcast sends it straight from
        # rank 0) and then fails at the next collective, the reduction of the same step
        ("between_steps", {0: {BROADCAST}, 2: {BROADCAST, REDUCTION}}),
        ("backward", {0: {REDUCTION}, 2: {REDUCTION}}),
        ("reduction", {0: {REDUCTION}, 2: {REDUCTION}}),
    ],
)
def test_survivors_name_the_dead_rank(phase: str, where: dict[int, set[str]]) -> None:
    results = run_distributed(
        _kill_during, 3, phase, expect_dead=frozenset({VICTIM}), timeout_s=90, pg_timeout_s=PG_TIMEOUT_S
    )
    assert results[VICTIM] is None
    for rank in (0, 2):
        message = results[rank]
        places = [place for place in where[rank] if f"Rank {rank}: a collective failed during {place}" in message]
        assert places, message
        assert f"Rank(s) [{VICTIM}] did not answer a roll call" in message, message


def _store_host_exits_first(out_dir: str) -> str:
    """The PyTorch tutorial's launch (env://, the store in rank 0's process): rank 1 dies mid-backward,
    rank 0 fails, roll-calls and exits at once, and rank 2 reaches the reduction only afterwards."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model)
    calls = {"n": 0}

    def on_third_backward(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3 and rank == VICTIM:
            _die()
        if calls["n"] == 3 and rank == 2:
            time.sleep(7)  # slower than rank 0's failure, roll call (3 s) and exit
        return grad

    model.head.weight.register_hook(on_third_backward)
    try:
        for step in range(5):
            x, y = global_batch("mlp", world, step)
            loss_fn(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
    except RuntimeError as error:
        if rank == 0:  # as a script would: the exception ends the process, and the store with it
            Path(out_dir, "rank0.txt").write_text(str(error))
            os._exit(1)
        return str(error)
    return "no error"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("attempt", range(3))
def test_a_survivor_after_the_store_host_exited_still_names_the_dead_rank(attempt: int, tmp_path: Path) -> None:
    results = run_distributed(
        _store_host_exits_first,
        3,
        str(tmp_path),
        expect_dead=frozenset({0, VICTIM}),
        timeout_s=90,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    first = (tmp_path / "rank0.txt").read_text()
    assert f"Rank(s) [{VICTIM}] did not answer a roll call" in first, first
    late = results[2]
    assert "no longer answers" in late, late  # the store went with rank 0 ...
    assert f"found that rank(s) [{VICTIM}] did not answer" in late, late  # ... and rank 1 is named anyway
    assert "rank 0 has probably died" not in late
