"""Accelerate on gradsync: ``gradsync.install()`` before ``Accelerator()``, checked against torch's DDP.

Every scenario trains the same tiny model on the same per-rank batches twice in the same two
gloo workers: once with torch's DDP, once with gradsync's (installed, so the
``torch.nn.parallel.DistributedDataParallel(model, **kwargs)`` in ``Accelerator.prepare`` builds
gradsync's). Each rank also computes, in one process, the reference (one SGD step per optimizer
step on all ranks' micro-batches at once) and a negative control (its own batches only: what a
run that never averages gives). The test process then checks, per scenario:

- the object ``prepare`` built is gradsync's (and torch's in the torch run: ``uninstall`` worked);
- replicas and the last averaged gradients are bitwise equal across ranks;
- gradsync's final weights and gradients are bitwise torch DDP's;
- both are close to the reference and the control is not, so the checks above would catch a run
  whose gradients were never averaged (the symptom of issue #12).

All scenarios share one isolated pair of workers: Accelerate keeps process-wide singletons and
reads RANK/WORLD_SIZE from the environment, which must not leak into the shared worker pool.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_distributed
from integration_support import assert_built_by, assert_equal, gradsync_installed, max_diff, run_each, scenario_ranks

pytest.importorskip("accelerate")

LR = 0.1
BATCH = 4  # per rank and micro-batch
SAMPLES = 48  # 6 batches per rank
RUN_TIMEOUT_S = 100
Batch = tuple  # (x, y)
Grads = dict  # parameter name -> gradient


class Net(nn.Module):
    """Two layers, and a middle one that ``skip=True`` leaves out of forward (find_unused_parameters)."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if not self.skip:
            h = torch.tanh(self.mid(h))
        return self.fc2(h)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


class Scenario(NamedTuple):
    loop: str = "plain"  # plain | accumulate | no_sync | trigger_sync (see _train)
    ddp_kwargs: dict = {}  # DistributedDataParallelKwargs fields; comm_hook by value
    skip: bool = False  # leave Net.mid out of forward


SCENARIOS = {
    "plain": Scenario(),
    "accumulate": Scenario(loop="accumulate"),
    "no_sync": Scenario(loop="no_sync"),
    "trigger_sync_in_backward": Scenario(loop="trigger_sync"),
    "find_unused_parameters": Scenario(ddp_kwargs={"find_unused_parameters": True}, skip=True),
    "static_graph": Scenario(ddp_kwargs={"static_graph": True}),
    "fp16_comm_hook": Scenario(ddp_kwargs={"comm_hook": "fp16"}),
}


# ---------------------------------------------------------------------------------- in the workers


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))


def _new_accelerator(scenario: Scenario) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator per run, as in a new script
    GradientState._reset_state()
    kwargs = dict(scenario.ddp_kwargs)
    if "comm_hook" in kwargs:
        kwargs["comm_hook"] = DDPCommunicationHookType(kwargs["comm_hook"])
    return Accelerator(
        cpu=True,
        gradient_accumulation_steps=2 if scenario.loop == "accumulate" else 1,
        kwargs_handlers=[DistributedDataParallelKwargs(**kwargs)],
    )


def _grads(bare: nn.Module) -> Grads:
    return {n: p.grad.clone() for n, p in bare.named_parameters() if p.grad is not None}


class Trained(NamedTuple):
    steps: list[list[Batch]]  # the micro-batches of each optimizer step
    grads: Grads  # at the last optimizer step: averaged
    local_grads: Grads  # after the last backward that must not sync (accumulation loops only)


def _train(
    accelerator: Any, model: nn.Module, bare: nn.Module, opt: Any, loader: Any, loop: str, trigger: bool = True
) -> Trained:
    """Train on every batch of ``loader``.

    ``trigger=False`` leaves ``trigger_sync_in_backward`` out: what Accelerate did when its
    isinstance check failed (issue #12), a negative control.
    """
    out = Trained([], {}, {})
    batches = iter(loader)
    if loop == "plain":
        for x, y in batches:
            accelerator.backward(_loss(model(x), y))
            out.steps.append([(x, y)])
            out.grads.update(_grads(bare))
            opt.step()
            opt.zero_grad()
    elif loop == "accumulate":
        pending: list[Batch] = []
        for x, y in batches:
            with accelerator.accumulate(model):  # no_sync on every other batch (2 accumulation steps)
                accelerator.backward(_loss(model(x), y))  # Accelerate divides by the accumulation steps
                pending.append((x, y))
                (out.grads if accelerator.sync_gradients else out.local_grads).update(_grads(bare))
                if accelerator.sync_gradients:
                    out.steps.append(pending)
                    pending = []
                opt.step()  # AcceleratedOptimizer skips step and zero_grad while accumulating
                opt.zero_grad()
    else:
        for (xa, ya), (xb, yb) in zip(batches, batches):
            if loop == "no_sync":
                with accelerator.no_sync(model):
                    accelerator.backward(_loss(model(xa), ya) / 2)
                out.local_grads.update(_grads(bare))
                accelerator.backward(_loss(model(xb), yb) / 2)
            else:  # trigger_sync, Accelerate's own pattern: both forwards unsynced, only the last backward syncs
                with accelerator.no_sync(model):
                    loss_a = _loss(model(xa), ya) / 2
                    loss_b = _loss(model(xb), yb) / 2
                accelerator.backward(loss_a)  # outside no_sync, but its forward was not: no sync
                out.local_grads.update(_grads(bare))
                with accelerator.trigger_sync_in_backward(model) if trigger else nullcontext():
                    accelerator.backward(loss_b)
            out.steps.append([(xa, ya), (xb, yb)])
            out.grads.update(_grads(bare))
            opt.step()
            opt.zero_grad()
    return out


def _run(scenario: Scenario, use_gradsync: bool, save_dir: str, trigger: bool = True) -> dict[str, Any]:
    """One training run with a fresh Accelerator; what the test process compares."""
    with gradsync_installed() if use_gradsync else nullcontext():
        accelerator = _new_accelerator(scenario)
        torch.manual_seed(1)
        bare = Net(scenario.skip)
        init = {k: v.clone() for k, v in bare.state_dict().items()}
        opt = torch.optim.SGD(bare.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, shuffle=False)
        model, opt, loader = accelerator.prepare(bare, opt, loader)
        trained = _train(accelerator, model, bare, opt, loader, scenario.loop, trigger)
        result = {
            "type": f"{type(model).__module__}.{type(model).__qualname__}",
            "init": init,
            "steps": trained.steps,
            "weights": {k: v.clone() for k, v in bare.state_dict().items()},
            "grads": trained.grads,
            "local_grads": trained.local_grads,
            "unwrapped_is_bare": accelerator.unwrap_model(model) is bare,
            "state_dict_keys": sorted(accelerator.get_state_dict(model)),
        }
        if scenario.loop == "plain":
            result["saved"] = _save_and_reload(accelerator, model, save_dir, scenario.skip)
    return result


def _save_and_reload(accelerator: Any, model: nn.Module, save_dir: str, skip: bool) -> dict[str, torch.Tensor]:
    """``accelerator.save_model`` (the main process writes), then every rank loads it into a bare model."""
    from safetensors.torch import load_file

    accelerator.save_model(model, save_dir)
    accelerator.wait_for_everyone()
    fresh = Net(skip)
    fresh.load_state_dict(load_file(os.path.join(save_dir, "model.safetensors")))  # strict: no "module." keys
    return fresh.state_dict()


def _reference(init: dict, steps: list[list[Batch]], skip: bool) -> dict[str, torch.Tensor]:
    """One process, plain SGD, one step per entry of ``steps`` on all its micro-batches at once."""
    model = Net(skip)
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for micro in steps:
        opt.zero_grad()
        _loss(model(torch.cat([x for x, _ in micro])), torch.cat([y for _, y in micro])).backward()
        opt.step()
    return model.state_dict()


def _scenario(name: str, save_root: str) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    out: dict[str, Any] = {}
    for run, use_gradsync in (("torch", False), ("gradsync", True)):
        out[run] = _run(scenario, use_gradsync, os.path.join(save_root, f"{name}-{run}"))
    if scenario.loop == "trigger_sync":
        out["gradsync_without_trigger"] = _run(scenario, True, "", trigger=False)
    own = out["torch"]["steps"]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    global_steps = [sum((rank_steps[i] for rank_steps in everyone), []) for i in range(len(own))]
    out["reference"] = _reference(out["torch"]["init"], global_steps, scenario.skip)
    out["control"] = _reference(out["torch"]["init"], own, scenario.skip)
    return out


def _all_scenarios(save_root: str) -> dict[str, Any]:
    return run_each(SCENARIOS, _scenario, save_root)


# ---------------------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    save_root = str(tmp_path_factory.mktemp("accelerate"))
    return run_distributed(_all_scenarios, 2, save_root, timeout_s=RUN_TIMEOUT_S, isolated=True, pg_timeout_s=30)


def _same_batches(a: list[list[Batch]], b: list[list[Batch]]) -> bool:
    flat_a = [t for step in a for batch in step for t in batch]
    flat_b = [t for step in b for batch in step for t in batch]
    return len(flat_a) == len(flat_b) and all(torch.equal(s, t) for s, t in zip(flat_a, flat_b))


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_accelerate_matches_torch_ddp(results: list[dict[str, Any]], name: str) -> None:
    r0, r1 = ranks = scenario_ranks(results, name)
    ours, theirs = r0["gradsync"], r0["torch"]
    assert_built_by(ours, theirs)
    assert _same_batches(ours["steps"], theirs["steps"]), "the two runs saw different batches"
    for run in ("torch", "gradsync"):
        assert_equal(r0[run]["weights"], r1[run]["weights"], f"{run}: rank 0 vs rank 1 weights")
        assert_equal(r0[run]["grads"], r1[run]["grads"], f"{run}: rank 0 vs rank 1 last averaged gradients")
        assert r0[run]["unwrapped_is_bare"], f"{run}: accelerator.unwrap_model did not return the inner module"
        assert r0[run]["state_dict_keys"] == sorted(r0[run]["weights"]), r0[run]["state_dict_keys"]
    assert_equal(ours["grads"], theirs["grads"], "gradsync vs torch DDP: last averaged gradients")
    if SCENARIOS[name].loop != "plain":  # the backward that must not sync did not, as with torch's DDP
        assert_equal(ours["local_grads"], theirs["local_grads"], "gradsync vs torch DDP: unsynced gradients")
        assert max_diff(r0["gradsync"]["local_grads"], r1["gradsync"]["local_grads"]) > 1e-3, "they were synced"
    assert_equal(ours["weights"], theirs["weights"], "gradsync vs torch DDP: final weights")
    # Against the one-process reference: not bitwise (a mean of per-rank means vs one mean); with
    # the fp16 hook every gradient is rounded to 11 significant bits before averaging (3e-5 here).
    atol = 1e-4 if name == "fp16_comm_hook" else 1e-6
    for rank, r in enumerate(ranks):
        diff = max_diff(r["gradsync"]["weights"], r["reference"])
        assert diff <= atol, f"rank {rank}: gradsync is {diff:.3g} from the one-process reference"
        # Teeth: this rank's batches alone (never averaged) end far from the reference.
        assert max_diff(r["control"], r["reference"]) > 100 * atol, "the negative control is no control"
    assert max_diff(r0["control"], r1["control"]) > 0, "both ranks saw the same data: cross-rank checks prove nothing"
    if "saved" in ours:
        assert_equal(ours["saved"], ours["weights"], "accelerator.save_model reloaded into a bare Net")
    if name == "find_unused_parameters":
        assert not any(k.startswith("mid.") for k in ours["grads"]), sorted(ours["grads"])
        assert torch.equal(ours["weights"]["mid.weight"], ours["init"]["mid.weight"]), "the skipped layer moved"
    if name == "fp16_comm_hook":  # the hook ran: fp32 averaging ends elsewhere
        assert max_diff(ours["weights"], results[0]["plain"]["gradsync"]["weights"]) > 0, "fp16 hook had no effect"
    if name == "trigger_sync_in_backward":  # without the trigger, what isinstance failing did: never averaged
        c0, c1 = r0["gradsync_without_trigger"], r1["gradsync_without_trigger"]
        assert max_diff(c0["grads"], c1["grads"]) > 1e-3, "gradients averaged even without trigger_sync_in_backward"
