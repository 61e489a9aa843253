"""The parameters' all-gathers overlapping the next forward (the default), and what keeps that exact.

Each test trains a ``ShardedOptimizer`` with default arguments beside gradsync DDP + the same
unsharded torch optimizer (held to single-process training by tests/test_parity.py), from the same
weights on the same batches, and reads the parameters the way user code does. Most run with *lazy
gathers*: an all-gather starts only when it is waited for, so any read the waits miss sees the
ranges of the other rank from before the step, every time, instead of only when the gather happens
to be slow.
"""

from __future__ import annotations

import copy
import io
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradsync.zero.param_buffers as param_buffers
from gradsync import DistributedDataParallel as DDP
from gradsync.zero import ShardedOptimizer

from harness import run_distributed
from models import global_batch, loss_fn, rank_world, shard
from zero_support import identical_across_ranks, max_relative_difference

CAPS = 0.0005  # small buckets: modules' parameters end up in different buckets


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LazyGather:
    """An all-gather that starts when it is waited for: a read before the wait sees the old ranges."""

    def __init__(self, start: Callable[..., Any], *args: Any) -> None:
        self.start, self.args = start, args

    def wait(self) -> bool:
        return self.start(*self.args).wait()


@contextmanager
def lazy_gathers() -> Iterator[None]:
    real = param_buffers.start_all_gather
    param_buffers.start_all_gather = lambda *args: LazyGather(real, *args)
    try:
        yield
    finally:
        param_buffers.start_all_gather = real


# ---------------------------------------------------------------------- models whose modules read others' parameters
class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.mha = nn.MultiheadAttention(16, 2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).unsqueeze(1)
        a, _ = self.mha(h, h, h)
        return self.head(a.squeeze(1))


class ReadsAhead(nn.Module):
    """The root reads a child's weight before calling it, and a weight of a module it never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.never_called = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) + 0.1 * self.head.weight.sum()
        h = F.linear(h, self.never_called.weight, self.never_called.bias) + self.b(h)
        return self.head(torch.tanh(h))


class LateBranch(nn.Module):
    """An attention branch the first forwards do not take: its module never ran when the reads were learned."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.mha = nn.MultiheadAttention(16, 2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, attend: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if attend:
            a, _ = self.mha(h.unsqueeze(1), h.unsqueeze(1), h.unsqueeze(1))
            h = h + a.squeeze(1)
        return self.head(h)


MODELS = {"attention": Attention, "reads_ahead": ReadsAhead, "late_branch": LateBranch}


def _pair(
    name: str, ddp_options: dict | None = None, optimizer_class: type = torch.optim.Adam, **sharded_options: Any
) -> tuple[DDP, ShardedOptimizer, DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MODELS[name]()
    reference_model = copy.deepcopy(model)
    options = {"bucket_cap_mb": CAPS, **(ddp_options or {})}
    ddp, reference = DDP(model, **options), DDP(reference_model, **options)
    return (
        ddp,
        ShardedOptimizer(ddp, optimizer_class, lr=1e-2, **sharded_options),
        reference,
        optimizer_class(reference_model.parameters(), lr=1e-2),
    )


def _step(wrapper: DDP, optimizer: torch.optim.Optimizer, step: int, **kwargs: Any) -> None:
    rank, world = rank_world()
    x, y = global_batch("mlp", world, step)
    optimizer.zero_grad()
    loss_fn(wrapper(shard(x, rank, world), **kwargs), shard(y, rank, world)).backward()
    optimizer.step()


def _train_both(pair: tuple[DDP, ShardedOptimizer, DDP, torch.optim.Optimizer], steps: int,
                kwargs: Any = lambda step: {}) -> dict:  # fmt: skip
    """``steps`` steps of the sharded pair, then of the reference pair; how far apart they ended."""
    ddp, sharded, reference, plain = pair
    for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
        for step in range(steps):
            _step(wrapper, optimizer, step, **kwargs(step))
    sharded.wait_for_params()
    return {
        "difference": max_relative_difference(ddp.module, reference.module),
        "identical": identical_across_ranks(ddp.module),
    }


# ---------------------------------------------------------------------- the forward's waits
def _reads_in_forward(name: str, lazy: bool) -> dict:
    pair = _pair(name, {"find_unused_parameters": name == "late_branch"})
    kwargs = (lambda step: {"attend": step >= 2}) if name == "late_branch" else (lambda step: {})
    with lazy_gathers() if lazy else nullcontext():
        outcome = _train_both(pair, 6, kwargs)
    return {**outcome, "buckets": len(pair[0].engine.buckets.storages)}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_module_that_reads_other_modules_parameters_waits_for_them(name: str) -> None:
    """MultiheadAttention's out_proj, a weight read before its module runs or by a module that never runs
    it, a branch first taken after the reads were learned: each read sees the stepped parameters."""
    for lazy in (True, False):
        for result in run_distributed(_reads_in_forward, 2, name, lazy):
            assert result["buckets"] >= 3, result
            assert result["identical"] and result["difference"] <= 1e-6, (lazy, result)


# ---------------------------------------------------------------------- reads between a step and the next forward
def _views(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The parameters as user code reads them after ``step()``, each way a copy of its own."""
    params = list(model.parameters())
    buffer = io.BytesIO()
    torch.save(params[0], buffer)  # a parameter saved by itself
    buffer.seek(0)
    ema = [torch.zeros_like(p) for p in params]
    torch._foreach_lerp_(ema, params, 0.5)  # an EMA update, as torch.optim.swa_utils and timm do it
    return {
        "detach": [p.detach().clone() for p in params],
        "data": [p.data.clone() for p in params],
        "numpy": [torch.from_numpy(p.data.numpy().copy()) for p in params],
        "vector": [torch.nn.utils.parameters_to_vector(params)],
        "deepcopy": [p.detach() for p in copy.deepcopy(model).parameters()],
        "saved": [torch.load(buffer)],
        "ema": ema,
        "norm": [torch.stack([p.norm() for p in params])],
    }


def _reads_after_step(name: str) -> dict:
    ddp, sharded, reference, plain = _pair(name)
    seen: dict[str, list[dict]] = {"sharded": [], "reference": []}
    with lazy_gathers():
        for label, wrapper, optimizer in (("sharded", ddp, sharded), ("reference", reference, plain)):
            for step in range(4):
                _step(wrapper, optimizer, step)
                if step == 2:  # a write between the step and the forward (WGAN's weight clipping)
                    for p in wrapper.module.parameters():
                        p.data.clamp_(-0.2, 0.2)
                seen[label].append(_views(wrapper.module))
        waits = sharded._params.guard.waits
    worst = 0.0
    for mine, theirs in zip(seen["sharded"], seen["reference"]):
        for way in mine:
            for a, b in zip(mine[way], theirs[way]):
                worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
    return {"difference": worst, "guard_waits": waits, "identical": identical_across_ranks(ddp.module)}


def test_reads_and_writes_between_step_and_forward_see_the_stepped_parameters() -> None:
    """No ``wait_for_params()``: ``.detach()``, ``.data``, ``numpy()``, ``parameters_to_vector``, ``deepcopy``,
    ``torch.save``, ``_foreach_lerp_``, norms and an in-place clamp after each step equal DDP's."""
    for result in run_distributed(_reads_after_step, 2, "attention"):
        assert result["guard_waits"] > 0, result
        assert result["identical"] and result["difference"] <= 1e-6, result


def _evaluation_after_step() -> dict:
    """An evaluation right after ``step()``, through the inner module and through one of its children."""
    ddp, sharded, reference, plain = _pair("attention")
    rank, world = rank_world()
    x, _ = global_batch("mlp", world, 99)
    outputs: dict[str, list[torch.Tensor]] = {"sharded": [], "reference": []}
    with lazy_gathers():
        for label, wrapper, optimizer in (("sharded", ddp, sharded), ("reference", reference, plain)):
            for step in range(3):
                _step(wrapper, optimizer, step)
                with torch.no_grad():
                    h = x.unsqueeze(1)
                    outputs[label].append(wrapper.module.mha(h, h, h)[0])  # a child alone, first
                    outputs[label].append(wrapper.module(x))
    return {"equal": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*outputs.values()))}


def test_an_evaluation_right_after_step_uses_the_stepped_parameters() -> None:
    assert all(result["equal"] for result in run_distributed(_evaluation_after_step, 2))


# ---------------------------------------------------------------------- the overlap itself, and other dispatch modes
def _overlapped() -> dict:
    ddp, sharded, _, _ = _pair("attention")
    rank, world = rank_world()
    seen = []
    for step in range(4):
        _step(ddp, sharded, step)
        x, _ = global_batch("mlp", world, step)
        in_flight, modes = len(sharded._params.pending), torch._C._len_torch_dispatch_stack()
        with torch.no_grad():
            ddp(shard(x, rank, world))  # a forward: the gathers are waited for in it
        seen.append((in_flight, modes, len(sharded._params.pending), torch._C._len_torch_dispatch_stack()))
    return {"seen": seen, "buckets": len(ddp.engine.buckets.storages)}


def test_by_default_step_returns_with_the_gathers_in_flight() -> None:
    """After ``step()`` every bucket's gather is in flight and the guard is on the mode stack; after the next
    forward nothing is in flight and the mode stack is empty again."""
    for result in run_distributed(_overlapped, 2):
        assert all(seen == (result["buckets"], 1, 0, 0) for seen in result["seen"]), result


class DecayingSGD(torch.optim.Optimizer):
    """Elementwise, but its learning rate falls with the number of ``step`` calls: stepped in parts, it would
    decay once per bucket instead of once per step."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.calls)


def _steps_of(optimizer_class: type, elementwise: bool | None) -> dict:
    # find_unused_parameters: no bucket rebuild, which would build the inner optimizer anew (its count with it)
    pair = _pair("attention", {"find_unused_parameters": True}, optimizer_class, elementwise=elementwise)
    return {**_train_both(pair, 4), "buckets": len(pair[0].engine.buckets.storages)}


@pytest.mark.parametrize("optimizer", ["adamw", "decaying_sgd"])
def test_stepping_bucket_by_bucket_is_one_step(optimizer: str) -> None:
    """With the gathers overlapped, the shards are stepped bucket by bucket, each bucket's gather leaving once
    it is stepped ([Note: gathers that leave as buckets are stepped]): torch's elementwise optimizers give
    the parameters of one step over everything; one vouched for with ``elementwise=True`` (which may count
    its calls) is stepped in one call."""
    args = (torch.optim.AdamW, None) if optimizer == "adamw" else (DecayingSGD, True)
    for result in run_distributed(_steps_of, 2, *args):
        assert result["buckets"] >= 3, result
        assert result["identical"] and result["difference"] <= 1e-6, result


class CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _with_a_users_mode(where: str) -> dict:
    """A user's dispatch mode around a whole step ("around": the guard cannot go on the stack, the step
    waits), or entered after ``step()`` and left after the next forward ("across": above the guard)."""
    ddp, sharded, reference, plain = _pair("attention")
    rank, world = rank_world()
    depths = []
    with lazy_gathers():
        for wrapper, optimizer in ((ddp, sharded), (reference, plain)):
            for step in range(4):
                mode = CountingMode()
                x, y = global_batch("mlp", world, step)
                if where == "around":
                    with mode:
                        _step(wrapper, optimizer, step)
                else:
                    optimizer.zero_grad()
                    loss_fn(wrapper(shard(x, rank, world)), shard(y, rank, world)).backward()
                    optimizer.step()
                    with mode:
                        wrapper(shard(x, rank, world))
                depths.append((mode.calls > 0, torch._C._len_torch_dispatch_stack()))
            wrapper(shard(x, rank, world))  # the next forward takes the guard off the stack
            depths.append((True, torch._C._len_torch_dispatch_stack()))
    return {
        "difference": max_relative_difference(ddp.module, reference.module),
        "identical": identical_across_ranks(ddp.module),
        "depths": depths,
    }


@pytest.mark.parametrize("where", ["around", "across"])
def test_a_users_dispatch_mode_keeps_its_place_on_the_stack(where: str) -> None:
    for result in run_distributed(_with_a_users_mode, 2, where):
        assert result["identical"] and result["difference"] <= 1e-6, result
        # the user's mode saw operators and was popped by its own exit; at most the guard stays until the next forward
        assert all(called and depth <= 1 for called, depth in result["depths"]), result
        assert result["depths"][-1] == (True, 0), result


def _first_forward_raises() -> dict:
    """The first forward raises half-way, in the attention (its record of reads is partial): the next one learns."""
    ddp, sharded, reference, plain = _pair("attention")
    rank, world = rank_world()
    x, _ = global_batch("mlp", world, 0)

    def fail(module: nn.Module, args: Any) -> None:
        raise RuntimeError("a forward that fails half-way")

    handle = ddp.module.mha.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="half-way"):
        ddp(shard(x, rank, world))
    handle.remove()
    with lazy_gathers():
        outcome = _train_both((ddp, sharded, reference, plain), 5)
    return {**outcome, "modes": torch._C._len_torch_dispatch_stack()}


def test_a_first_forward_that_raises_leaves_the_learning_to_the_next() -> None:
    for result in run_distributed(_first_forward_raises, 2):
        assert result["identical"] and result["difference"] <= 1e-6 and result["modes"] == 0, result


# ---------------------------------------------------------------------- a program that ends right after step()
def _end_right_after_step(mode: str) -> list[dict]:
    script = Path(__file__).parent / "jobs" / "zero_ending.py"
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), port, str(rank), "2", mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for process in ranks:
        try:
            out, err = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0, f"exit code {process.returncode}:\n{err[-2000:]}"
        assert "terminate called" not in err, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_a_program_may_end_with_the_gathers_in_flight() -> None:
    """The interpreter's exit lets the exchanges finish (a daemon thread left waiting in C++ aborts it)."""
    results = _end_right_after_step("exit")
    assert all(result["in_flight"] > 0 for result in results), results


def test_a_gather_cut_off_by_destroy_process_group_is_named_with_its_fix() -> None:
    for result in _end_right_after_step("destroy"):
        assert result["error"] is not None and "all-gather of the parameters" in result["error"], result
        assert "call optimizer.wait_for_params() before dist.destroy_process_group()" in result["error"], result


# ---------------------------------------------------------------------- torch.compile
def _compiled(where: str) -> dict:
    """``DDP(torch.compile(model))`` ("inner") or ``torch.compile(DDP(model))`` ("outer"), aot_eager."""
    rank, world = rank_world()
    torch.manual_seed(0)
    model = Attention()
    reference_model = copy.deepcopy(model)
    ddp = DDP(torch.compile(model, backend="aot_eager") if where == "inner" else model, bucket_cap_mb=CAPS)
    reference = DDP(reference_model, bucket_cap_mb=CAPS)
    call = torch.compile(ddp, backend="aot_eager") if where == "outer" else ddp
    sharded = ShardedOptimizer(ddp, torch.optim.Adam, lr=1e-2)
    plain = torch.optim.Adam(reference_model.parameters(), lr=1e-2)
    try:
        with lazy_gathers():
            for wrapper, optimizer in ((call, sharded), (reference, plain)):
                for step in range(5):
                    _step(wrapper, optimizer, step)
            sharded.wait_for_params()
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    return {
        "difference": max_relative_difference(model, reference_model),
        "identical": identical_across_ranks(model),
        "graphs": frames,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["inner", "outer"])
def test_a_compiled_model_trains_like_the_eager_reference(where: str) -> None:
    """The hooks run eagerly (graph breaks), the modes never make torch.compile skip the model, and the
    mode stack is not changed inside a compiled call (its backward would fail torch's internal assert)."""
    for result in run_distributed(_compiled, 2, where, timeout_s=200):
        assert result["graphs"] > 0, result
        assert result["identical"] and result["difference"] <= 1e-6, result


def _another_model_after_a_run() -> dict:
    """A run ends with its gathers in flight and nobody reads its parameters again (the optimizer lives on);
    another model trains next: the first guard leaves the stack once its gathers arrived."""
    first, first_optimizer, _, _ = _pair("attention")
    for step in range(2):
        _step(first, first_optimizer, step)
    armed = torch._C._len_torch_dispatch_stack()
    first_optimizer._params.pending[next(iter(first_optimizer._params.pending))].wait()  # arrived, not taken
    time.sleep(0.5)
    second, second_optimizer, _, _ = _pair("reads_ahead")
    depths = []
    for step in range(3):
        _step(second, second_optimizer, step)
        with torch.no_grad():
            second(torch.zeros(4, 16))
        depths.append(torch._C._len_torch_dispatch_stack())
    first_optimizer.wait_for_params()
    return {"armed": armed, "depths": depths}


def test_a_finished_runs_guard_does_not_stay_on_the_stack() -> None:
    for result in run_distributed(_another_model_after_a_run, 2):
        assert result["armed"] == 1 and result["depths"] == [0, 0, 0], result


class FailingGather:
    def wait(self) -> None:
        raise RuntimeError("a gather that broke off")

    def is_completed(self) -> bool:
        return True


def _forward_after_a_failed_gather() -> dict:
    """A gather failed and a read between step() and the forward saw it; the forward raises the same error
    before a module computes with the bucket, not only at its end."""
    ddp, sharded, _, _ = _pair("attention")
    _step(ddp, sharded, 0)
    real = param_buffers.start_all_gather
    param_buffers.start_all_gather = lambda *args: FailingGather()
    try:
        _step(ddp, sharded, 1)
    finally:
        param_buffers.start_all_gather = real
    errors = []
    for param in ddp.module.parameters():  # every bucket's failure seen: none is in flight any more
        try:
            param.sum()
        except RuntimeError as error:
            errors.append(str(error))
    in_flight = len(sharded._params.pending)
    computed = []
    handle = ddp.module.head.register_forward_hook(lambda *_: computed.append(True))
    rank, world = rank_world()
    try:
        with torch.no_grad():
            ddp(shard(global_batch("mlp", world, 2)[0], rank, world))
    except RuntimeError as error:
        errors.append(str(error))
    handle.remove()
    sharded._params.wait_all_ignoring()  # as a state dict loaded next would
    return {"errors": errors, "head_computed": bool(computed), "in_flight": in_flight}


def test_a_failed_gather_raises_before_a_module_uses_it() -> None:
    for result in run_distributed(_forward_after_a_failed_gather, 2):
        assert result["in_flight"] == 0 and len(result["errors"]) > 1, result
        assert all("a gather that broke off" in e for e in result["errors"]), result
        assert not result["head_computed"], result
