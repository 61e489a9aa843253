"""Ignite on gradsync: ``gradsync.install()`` before ``idist.auto_model(model)``, checked against torch's DDP.

``idist.auto_model`` wraps with ``torch.nn.parallel.DistributedDataParallel(model)`` when the
world size is above 1; installed, that builds gradsync's. ``Checkpoint`` and ``EMAHandler``
unwrap the model only when ``isinstance(model, nn.parallel.DistributedDataParallel)`` holds.
Each scenario trains a tiny model with ``create_supervised_trainer`` on per-rank shards from
``idist.auto_dataloader``, with a ``Checkpoint`` and an ``EMAHandler`` attached, three times in the same
two gloo workers (torch's DDP, then gradsync's installed, then gradsync's wrapped by hand without
install: the frameworks' isinstance checks then hold only through its torch base class).
The test process checks:

- ``auto_model`` returned gradsync's wrapper;
- replicas (and EMA models) are bitwise equal across ranks, and bitwise torch DDP's;
- both are close to a one-process reference (SGD on both ranks' batches at once, the EMA folded
  by hand), and a rank's own batches alone (the negative control) end far from it;
- the checkpoint holds the inner module's keys (no ``module.``) and loads into a bare model
  (and back into the wrapped one with ``Checkpoint.load_objects``);
- the EMA model is a deep copy of the inner module, not of the wrapper.

One isolated pair of workers: ignite keeps its distributed context in module state and the test
sets RANK/LOCAL_RANK/WORLD_SIZE as torchrun would; none of it may leak into the shared pool.
"""

from __future__ import annotations

import glob
import os
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync

from harness import run_distributed
from integration_support import assert_equal, gradsync_installed, max_diff, run_each, scenario_ranks

pytest.importorskip("ignite")

LR = 0.1
EMA_MOMENTUM = 0.5  # large, so that the EMA model is far from both its start and the weights
GLOBAL_BATCH = 8  # auto_dataloader splits it: 4 per rank
SAMPLES = 48  # 6 iterations per rank
RUN_TIMEOUT_S = 100
SCENARIOS = {"plain": 1, "gradient_accumulation": 2}  # name -> create_supervised_trainer's accumulation steps
# torch's DDP via auto_model; gradsync's via auto_model after install(); gradsync's wrapped by
# hand without install, so Checkpoint and EMAHandler see it only through its torch base class.
RUNS = ("torch", "gradsync", "gradsync_direct")
OURS = RUNS[1:]
Weights = dict  # name -> tensor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


# ---------------------------------------------------------------------------------- in the workers


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 4, generator=g))


def _copy(module: nn.Module) -> Weights:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _run(accumulation: int, run: str, save_dir: str) -> dict[str, Any]:
    """One training run; ``run`` is one of RUNS."""
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_trainer
    from ignite.handlers import Checkpoint, DiskSaver, EMAHandler

    with gradsync_installed() if run == "gradsync" else nullcontext():
        torch.manual_seed(1)
        bare = Net()
        init = _copy(bare)
        model = gradsync.DistributedDataParallel(bare) if run == "gradsync_direct" else idist.auto_model(bare)
        opt = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=LR))
        loader = idist.auto_dataloader(_dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
        trainer = create_supervised_trainer(
            model, opt, nn.functional.mse_loss, gradient_accumulation_steps=accumulation
        )
        ema = EMAHandler(model, momentum=EMA_MOMENTUM)
        ema.attach(trainer, event=Events.ITERATION_COMPLETED)
        checkpoint = Checkpoint({"model": model}, DiskSaver(save_dir, require_empty=False), n_saved=1)
        trainer.add_event_handler(Events.COMPLETED, checkpoint)
        seen: list[tuple] = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: seen.append(engine.state.batch))
        trainer.run(loader, max_epochs=1)
        weights = _copy(bare)  # before load_objects below puts rank 0's checkpoint into every replica
        dist.barrier()  # rank 0 has written the checkpoint
        (path,) = glob.glob(os.path.join(save_dir, "*.pt"))
        saved = torch.load(path, weights_only=True)
        fresh = Net()
        fresh.load_state_dict(saved)  # strict: no "module." keys
        Checkpoint.load_objects(to_load={"model": model}, checkpoint=saved)  # and back into the wrapped model
        dist.barrier()  # nobody removes the file while another rank still reads it
        return {
            "type": f"{type(model).__module__}.{type(model).__qualname__}",
            "init": init,
            "seen": seen,
            "weights": weights,
            "saved_keys": sorted(saved),
            "reloaded": _copy(fresh),
            "ema_type": type(ema.ema_model).__name__,
            "ema": _copy(ema.ema_model),
        }


def _reference(init: Weights, iterations: list[list[tuple]], accumulation: int) -> tuple[Weights, Weights]:
    """One process: SGD on all micro-batches of each step at once; the EMA folded after every iteration."""
    model = Net()
    model.load_state_dict(init)
    ema = _copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i in range(0, len(iterations), accumulation):
        micro = [b for it in iterations[i : i + accumulation] for b in it]
        opt.zero_grad()
        x, y = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
        nn.functional.mse_loss(model(x), y).backward()
        for j in range(accumulation):
            if j == accumulation - 1:  # the optimizer steps at the last iteration of each step
                opt.step()
            weights = _copy(model)
            ema = {k: (1 - EMA_MOMENTUM) * ema[k] + EMA_MOMENTUM * weights[k] for k in ema}
    return _copy(model), ema


def _scenario(name: str, save_root: str) -> dict[str, Any]:
    accumulation = SCENARIOS[name]
    out: dict[str, Any] = {}
    for run in RUNS:
        out[run] = _run(accumulation, run, os.path.join(save_root, f"{name}-{run}"))
    own = [[b] for b in out["torch"]["seen"]]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    global_iterations = [sum((rank_its[i] for rank_its in everyone), []) for i in range(len(own))]
    init = out["torch"]["init"]
    out["reference"], out["reference_ema"] = _reference(init, global_iterations, accumulation)
    out["control"], out["control_ema"] = _reference(init, own, accumulation)
    return out


def _all_scenarios(save_root: str) -> dict[str, Any]:
    return run_each(SCENARIOS, _scenario, save_root)


# ---------------------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    save_root = str(tmp_path_factory.mktemp("ignite"))
    return run_distributed(_all_scenarios, 2, save_root, timeout_s=RUN_TIMEOUT_S, isolated=True, pg_timeout_s=30)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ignite_trainer_matches_torch_ddp(results: list[dict[str, Any]], name: str) -> None:
    r0, r1 = ranks = scenario_ranks(results, name)
    theirs = r0["torch"]
    assert theirs["type"] == "torch.nn.parallel.distributed.DistributedDataParallel", theirs["type"]
    for run in OURS:
        assert r0[run]["type"] == "gradsync.ddp.DistributedDataParallel", f"{run}: {r0[run]['type']}"
    for r in ranks:
        for run in OURS:
            seen = zip(r[run]["seen"], r["torch"]["seen"])
            assert all(torch.equal(a, b) for sa, sb in seen for a, b in zip(sa, sb)), f"{run} saw other batches"
    for run in RUNS:
        assert_equal(r0[run]["weights"], r1[run]["weights"], f"{run}: rank 0 vs rank 1 weights")
    for run in OURS:
        assert_equal(r0[run]["weights"], theirs["weights"], f"{run} vs torch DDP: final weights")
    for rank, r in enumerate(ranks):  # not bitwise: a mean of per-rank means against one mean
        diff = max_diff(r["gradsync"]["weights"], r["reference"])
        assert diff <= 1e-6, f"rank {rank}: gradsync is {diff:.3g} from the one-process reference"
        # Teeth: this rank's batches alone (never averaged) end far from the reference.
        assert max_diff(r["control"], r["reference"]) > 1e-3, "the negative control is no control"
    assert max_diff(r0["control"], r1["control"]) > 0, "both ranks saw the same data: cross-rank checks prove nothing"


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ignite_checkpoint_holds_the_inner_module(results: list[dict[str, Any]], name: str) -> None:
    for rank, r in enumerate(scenario_ranks(results, name)):
        for run in RUNS:
            keys = r[run]["saved_keys"]
            assert keys == sorted(r[run]["weights"]), f"rank {rank}, {run}: checkpoint keys {keys}"
            assert_equal(r[run]["reloaded"], r[run]["weights"], f"rank {rank}, {run}: checkpoint in a bare Net")


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ignite_ema_copies_the_inner_module(results: list[dict[str, Any]], name: str) -> None:
    r0, r1 = ranks = scenario_ranks(results, name)
    for run in RUNS:
        assert r0[run]["ema_type"] == "Net", f"{run}: EMAHandler deep-copied a {r0[run]['ema_type']}"
        assert sorted(r0[run]["ema"]) == sorted(r0[run]["weights"]), f"{run}: EMA keys {sorted(r0[run]['ema'])}"
        assert_equal(r0[run]["ema"], r1[run]["ema"], f"{run}: rank 0 vs rank 1 EMA model")
    for run in OURS:
        assert_equal(r0[run]["ema"], r0["torch"]["ema"], f"{run} vs torch DDP: EMA model")
    for rank, r in enumerate(ranks):
        diff = max_diff(r["gradsync"]["ema"], r["reference_ema"])
        assert diff <= 1e-6, f"rank {rank}: the EMA model is {diff:.3g} from the hand-folded one"
        assert max_diff(r["control_ema"], r["reference_ema"]) > 1e-3, "the negative control is no control"
        assert max_diff(r["gradsync"]["ema"], r["gradsync"]["weights"]) > 1e-3, "the EMA is just the weights"
