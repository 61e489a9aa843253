"""gradsync inside Lightning's Trainer and Fabric, each run checked against torch's DDP doing the same.

Every scenario trains the same tiny model twice in the same two gloo processes, once with
Lightning's own ``DDPStrategy`` (torch's DDP) and once with gradsync's strategy
(``gradsync.integrations.lightning``), and checks that

(a) each run's final weights are bitwise equal across ranks,
(b) gradsync's final weights are bitwise torch's,
(c) both are within float rounding of a one-process reference trained on the global batches,
    and the run took the path the scenario is named for (synced iterations, hook calls, ...).

``test_checks_catch_a_strategy_that_does_not_reduce`` shows that (a) and (c) fail for a
strategy that never all-reduces.

Lightning runs inside the harness's workers as in processes someone else launched
(``_launched_externally``): it finds ``LOCAL_RANK`` set, so it spawns nothing, and it reuses the
process group the harness made (Lightning skips ``init_process_group`` when one exists and
its teardown does not destroy it).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if importlib.util.find_spec("lightning") is None:
    pytest.importorskip("pytorch_lightning")

from gradsync import DistributedDataParallel as GradsyncDDP  # noqa: E402
from gradsync.integrations.lightning import (  # noqa: E402
    GradsyncDDPStrategy,
    GradsyncFabricDDPStrategy,
    lf,
    pl,
)

from harness import run_distributed  # noqa: E402
from integration_support import quiet_cpu_trainer  # noqa: E402

WORLD = 2
IN, HIDDEN, OUT = 8, 16, 4
BATCH = 4  # rows per rank per micro-batch
STEPS = 4  # optimizer steps per fit
LR = 0.1
Weights = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------- model and data
class _Mlp(nn.Module):
    """body -> (extra) -> head; with ``skip_odd``, ``extra`` sits out odd-numbered batches."""

    def __init__(self, skip_odd: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN, HIDDEN)
        self.extra = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.skip_odd = skip_odd

    def forward(self, x: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if not (self.skip_odd and batch_idx % 2):
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


class _Net(pl.LightningModule):
    """``_Mlp`` under Lightning; manual optimization steps every ``accumulate`` batches.

    Manual steps follow Lightning's documented recipe: ``manual_backward`` inside
    ``optimizer.toggle_model(sync_grad=is_last)`` (``no_sync`` until the last batch). With
    ``halves`` each batch takes two backward passes, one per half (both synced).
    """

    def __init__(self, manual: bool = False, skip_odd: bool = False, accumulate: int = 1, halves: bool = False) -> None:
        super().__init__()
        self.mlp = _Mlp(skip_odd)
        self.automatic_optimization = not manual
        self.accumulate = accumulate
        self.halves = halves

    def forward(self, x: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        return self.mlp(x, batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        if self.automatic_optimization:
            return F.mse_loss(self(x, batch_idx), y)
        optimizer = self.optimizers()
        is_last = (batch_idx + 1) % self.accumulate == 0
        parts = (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)) if self.halves else (slice(0, BATCH),)
        with optimizer.toggle_model(sync_grad=is_last):
            for rows in parts:
                loss = F.mse_loss(self(x[rows], batch_idx), y[rows]) / (len(parts) * self.accumulate)
                self.manual_backward(loss)  # DDPStrategy.pre_backward: reducer.prepare_for_backward
        if is_last:
            optimizer.step()
            optimizer.zero_grad()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _dataset(accumulate: int) -> TensorDataset:
    """Global micro-batch ``k`` is rows ``[k * WORLD * BATCH, (k + 1) * WORLD * BATCH)``.

    An unshuffled DistributedSampler deals rank ``r`` the rows ``r, r + WORLD, ...``, so the
    ranks' k-th batches together are exactly those rows.
    """
    g = torch.Generator().manual_seed(1)
    n = WORLD * BATCH * STEPS * accumulate
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))


def _reference(module: nn.Module, accumulate: int, fits: int = 1) -> Weights:
    """One process, global batches, the loss averaged over them: what DDP must reproduce."""
    x, y = _dataset(accumulate).tensors
    rows = WORLD * BATCH
    for _ in range(fits):
        optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        for step in range(STEPS):
            optimizer.zero_grad()
            for micro in range(accumulate):
                k = step * accumulate + micro
                batch = slice(k * rows, (k + 1) * rows)
                (F.mse_loss(module(x[batch], k), y[batch]) / accumulate).backward()
            optimizer.step()
    return _weights(module)


def _weights(module: nn.Module) -> Weights:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _gradsync_hooks(param: torch.Tensor) -> int:
    """Post-accumulate-grad hooks on ``param``: gradsync's, one per live wrapper (torch's DDP has none)."""
    return len(param._post_accumulate_grad_hooks or ())


# ---------------------------------------------------------------------------- running Lightning here
@contextmanager
def _launched_externally() -> Iterator[None]:
    """Make this harness worker look like a process Lightning did not start; undo it afterwards."""
    rank = dist.get_rank()
    saved_env = dict(os.environ)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    os.environ["OMP_NUM_THREADS"] = "1"  # else Lightning picks a thread count itself
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning_fabric", "lightning")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        torch.set_num_threads(1)
        assert dist.is_initialized(), "Lightning destroyed the harness's process group"


def _counted(hook: Any, calls: list[int]) -> Any:
    # No annotations: under ``from __future__ import annotations`` they are strings, and
    # torch's register_comm_hook rejects a ``bucket`` annotated other than dist.GradBucket.
    def counted_hook(state, bucket):
        calls.append(bucket.index())
        return hook(state, bucket)

    return counted_hook


class _TorchDDPHooksOnCPU(pl.strategies.DDPStrategy):
    """Lightning's strategy registering ``ddp_comm_hook`` on CPU too, as gradsync's does.

    Lightning's own registers comm hooks only on CUDA ([Note: comm hooks on CPU] in
    gradsync/integrations/lightning.py); torch's DDP runs them on gloo as well.
    """

    def _register_ddp_hooks(self) -> None:
        register = pl.overrides.distributed._register_ddp_comm_hook
        register(self.model, self._ddp_comm_state, self._ddp_comm_hook, self._ddp_comm_wrapper)


class _LocalOnlyStrategy(pl.strategies.DDPStrategy):
    """Deliberately broken: never wraps the model, so no gradient is ever all-reduced."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model


class _Probe(pl.Callback):
    """What the wrapper did, read while it still wraps the module (teardown discards it)."""

    def __init__(self, checkpoint: Optional[str] = None) -> None:
        self.checkpoint = checkpoint
        self.hooks_seen: set[int] = set()  # post-accumulate-grad hooks per parameter, over all steps
        self.info: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.hooks_seen.update(_gradsync_hooks(p) for p in pl_module.parameters())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wrapper = trainer.strategy.model
        self.info["wrapper"] = f"{type(wrapper).__module__}.{type(wrapper).__qualname__}"
        flags = ("static_graph", "find_unused_parameters")
        self.info["ddp_flags"] = {flag: getattr(wrapper, flag, None) for flag in flags}
        if isinstance(wrapper, GradsyncDDP):
            stats = wrapper.stats()
            self.info["synced_iterations"] = stats.iterations
            self.info["buckets"] = len(stats.buckets)
            self.info["unused_parameters"] = stats.unused_parameters
        if self.checkpoint is not None:
            trainer.save_checkpoint(self.checkpoint)  # mid-run, while the model is wrapped


def _fit(strategy: Any, net: _Net, accumulate: int, probe: _Probe, root: str) -> pl.Trainer:
    trainer = pl.Trainer(
        **quiet_cpu_trainer(WORLD, root),
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=1 if not net.automatic_optimization else accumulate,
        callbacks=[probe],
    )
    dataset = _dataset(accumulate)
    trainer.fit(net, DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False)))
    return trainer


# ---------------------------------------------------------------------------- Trainer scenarios
class Scenario(NamedTuple):
    manual: bool = False
    accumulate: int = 1
    skip_odd: bool = False
    ddp: dict[str, Any] = {}  # DDPStrategy(**ddp): passed on to the DDP wrapper
    comm_hook: bool = False  # ddp_comm_hook=fp16_compress_hook, counted
    halves: bool = False  # manual: two synced backward passes per batch
    # |reference - result| bound: float rounding of a different summation order, or fp16 wire values
    atol: float = 1e-6


SCENARIOS = {
    "automatic": Scenario(),
    "manual": Scenario(manual=True),
    "accumulate": Scenario(accumulate=2),
    "manual_accumulate": Scenario(manual=True, accumulate=2),
    "manual_two_backward": Scenario(manual=True, halves=True),
    "static_graph": Scenario(ddp={"static_graph": True}),
    "static_graph_manual": Scenario(manual=True, ddp={"static_graph": True}),
    "find_unused": Scenario(skip_odd=True, ddp={"find_unused_parameters": True}),
    "find_unused_manual": Scenario(manual=True, skip_odd=True, ddp={"find_unused_parameters": True}),
    "find_unused_accumulate": Scenario(accumulate=2, skip_odd=True, ddp={"find_unused_parameters": True}),
    "gradient_as_bucket_view": Scenario(ddp={"gradient_as_bucket_view": True}),
    # 1 kB buckets: several per step, each through the hook
    "fp16_comm_hook": Scenario(comm_hook=True, ddp={"bucket_cap_mb": 0.001}, atol=2e-3),
    # torch 2.13's DDP cannot run these: its first backward under no_sync with static_graph fails
    # with "expect_autograd_hooks_ INTERNAL ASSERT FAILED at reducer.cpp:1732". gradsync can.
    "static_graph_accumulate": Scenario(accumulate=2, ddp={"static_graph": True}),
    "static_graph_manual_accumulate": Scenario(manual=True, accumulate=2, ddp={"static_graph": True}),
}
TORCH_FAILS = ("static_graph_accumulate", "static_graph_manual_accumulate")
STRATEGIES = {"torch": pl.strategies.DDPStrategy, "gradsync": GradsyncDDPStrategy, "local_only": _LocalOnlyStrategy}
# Without arguments the strategies are named, as users would: Trainer(strategy="gradsync_ddp").
NAMES = {"torch": "ddp", "gradsync": "gradsync_ddp"}


def _trainer_scenario(name: str, root: str, runs: tuple[str, ...] = ("torch", "gradsync")) -> dict[str, Any]:
    """Fit scenario ``name`` once per strategy in ``runs``; weights and what each run did."""
    scenario = SCENARIOS[name]
    result: dict[str, Any] = {"reference": _reference(_Mlp(scenario.skip_odd), scenario.accumulate)}
    with _launched_externally():
        for run in runs:
            calls: list[int] = []
            kwargs = dict(scenario.ddp)
            strategy_class = STRATEGIES[run]
            if scenario.comm_hook:
                kwargs["ddp_comm_hook"] = _counted(fp16_compress_hook, calls)
                strategy_class = _TorchDDPHooksOnCPU if run == "torch" else strategy_class
            probe = _Probe(os.path.join(root, f"{run}.ckpt") if name == "automatic" else None)
            net = _Net(scenario.manual, scenario.skip_odd, scenario.accumulate, scenario.halves)
            strategy = strategy_class(**kwargs) if kwargs or run not in NAMES else NAMES[run]
            trainer = _fit(strategy, net, scenario.accumulate, probe, root)
            result[run] = {
                "weights": {k.removeprefix("mlp."): v for k, v in _weights(net).items()},
                "state_dict_keys": sorted(net.state_dict()),
                "hooks_seen": probe.hooks_seen,
                "hook_calls": len(calls),
                "static_graph_delay_done": trainer.strategy._pl_static_graph_delay_done,
                "batches": trainer.fit_loop.total_batch_idx + 1,
                **probe.info,
            }
    return result


def _check_replicas_agree(ranks: list[dict[str, Any]], run: str) -> None:
    """(a) every rank ends with bitwise the same weights."""
    for name, value in ranks[0][run]["weights"].items():
        for rank, other in enumerate(ranks[1:], start=1):
            assert torch.equal(value, other[run]["weights"][name]), f"{run}: {name} differs across ranks 0 and {rank}"


def _check_reference(ranks: list[dict[str, Any]], run: str, atol: float) -> None:
    """(c) the run trained on averaged gradients: the one-process reference's weights."""
    for name, value in ranks[0][run]["weights"].items():
        expected = ranks[0]["reference"][name]
        diff = (value - expected).abs().max()
        assert torch.allclose(value, expected, atol=atol, rtol=0), f"{run}: {name} is {diff} from the reference"


def _check_gradsync_is_torch(ranks: list[dict[str, Any]]) -> None:
    """(b) bitwise: gradsync divides then sums each bucket as torch's reducer does."""
    for rank, result in enumerate(ranks):
        for name, value in result["torch"]["weights"].items():
            diff = (result["gradsync"]["weights"][name] - value).abs().max()
            assert torch.equal(result["gradsync"]["weights"][name], value), f"rank {rank}: {name} {diff} from torch's"


def _check_path(name: str, ranks: list[dict[str, Any]], root: str) -> None:
    """(c) the scenario exercised what it is named for."""
    for result in ranks:
        torch_run, ours = result["torch"], result["gradsync"]
        assert ours["wrapper"] == "gradsync.ddp.DistributedDataParallel", ours["wrapper"]
        assert torch_run["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel", torch_run["wrapper"]
        # One gradsync hook per parameter (that of the live wrapper); torch's DDP registers none.
        assert ours["hooks_seen"] == {1} and torch_run["hooks_seen"] == {0}, (
            ours["hooks_seen"],
            torch_run["hooks_seen"],
        )
        scenario = SCENARIOS[name]
        flags = {"static_graph": False, "find_unused_parameters": False}
        expected_flags = {k: scenario.ddp.get(k, v) for k, v in flags.items()}
        assert ours["ddp_flags"] == torch_run["ddp_flags"] == expected_flags, (ours["ddp_flags"], expected_flags)
        # Synced backward passes: one per optimizer step (two with halves). Under accumulation the
        # others ran in no_sync; in manual optimization only reducer.prepare_for_backward arms the
        # reducer, since Lightning clears require_backward_grad_sync inside the forward.
        assert ours["batches"] == torch_run["batches"] == STEPS * scenario.accumulate
        assert ours["synced_iterations"] == STEPS * (2 if scenario.halves else 1), ours["synced_iterations"]
        if name == "static_graph_manual":  # Lightning called reducer._delay_all_reduce() after backward 1
            assert ours["static_graph_delay_done"] and torch_run["static_graph_delay_done"]
        if scenario.skip_odd:  # the last batch (3) is odd: extra sat out, on every rank
            assert ours["unused_parameters"] == ("mlp.extra.weight", "mlp.extra.bias"), ours["unused_parameters"]
        if scenario.comm_hook:  # the hook reduced every bucket of every synced step, in both
            assert ours["buckets"] > 1 and ours["hook_calls"] == STEPS * ours["buckets"], (ours["hook_calls"], ours)
            assert torch_run["hook_calls"] >= STEPS, torch_run["hook_calls"]
        if name == "automatic":
            _check_checkpoints(result, root)


def _check_checkpoints(result: dict[str, Any], root: str) -> None:
    """Saved mid-run while wrapped: no ``module.`` keys, and the file loads into a bare model."""
    assert not any("module." in key for key in result["gradsync"]["state_dict_keys"])
    for run in ("torch", "gradsync"):
        checkpoint = torch.load(os.path.join(root, f"{run}.ckpt"), weights_only=False)
        assert not any("module." in key for key in checkpoint["state_dict"]), sorted(checkpoint["state_dict"])
        fresh = _Net()
        fresh.load_state_dict(checkpoint["state_dict"])  # strict
        for name, value in _weights(fresh.mlp).items():
            assert torch.equal(value, result[run]["weights"][name]), f"{run} checkpoint: {name}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [name for name in SCENARIOS if name not in TORCH_FAILS])
def test_trainer_matches_torch_ddp(name: str, tmp_path: Any) -> None:
    ranks = run_distributed(_trainer_scenario, WORLD, name, str(tmp_path), timeout_s=100)
    for run in ("torch", "gradsync"):
        _check_replicas_agree(ranks, run)
        _check_reference(ranks, run, SCENARIOS[name].atol)
    _check_gradsync_is_torch(ranks)
    _check_path(name, ranks, str(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TORCH_FAILS)
def test_trainer_static_graph_with_accumulation(name: str, tmp_path: Any) -> None:
    """No torch run to compare with (see TORCH_FAILS): the reference is the oracle."""
    ranks = run_distributed(_trainer_scenario, WORLD, name, str(tmp_path), ("gradsync",), timeout_s=50)
    _check_replicas_agree(ranks, "gradsync")
    _check_reference(ranks, "gradsync", SCENARIOS[name].atol)
    for result in ranks:
        ours = result["gradsync"]
        assert ours["ddp_flags"]["static_graph"] and ours["hooks_seen"] == {1}
        assert ours["batches"] == 2 * STEPS and ours["synced_iterations"] == STEPS, ours
        assert ours["static_graph_delay_done"] == name.startswith("static_graph_manual")


@pytest.mark.timeout(60)
def test_checks_catch_a_strategy_that_does_not_reduce(tmp_path: Any) -> None:
    ranks = run_distributed(_trainer_scenario, WORLD, "automatic", str(tmp_path), ("local_only",), timeout_s=50)
    with pytest.raises(AssertionError, match="differs across ranks"):
        _check_replicas_agree(ranks, "local_only")
    with pytest.raises(AssertionError, match="from the reference"):
        _check_reference(ranks, "local_only", SCENARIOS["automatic"].atol)


# ---------------------------------------------------------------------------- two fits, one module
def _two_fits(root: str) -> dict[str, Any]:
    """``fit`` twice with the same LightningModule: Lightning wraps it anew and drops the old wrapper."""
    result: dict[str, Any] = {"reference": _reference(_Mlp(), accumulate=1, fits=2)}
    with _launched_externally():
        for run in ("torch", "gradsync"):
            net = _Net()
            probes = [_Probe(), _Probe()]
            for probe in probes:
                _fit(STRATEGIES[run](), net, 1, probe, root)
            gc.collect()
            result[run] = {
                "weights": {k.removeprefix("mlp."): v for k, v in _weights(net).items()},
                "hooks_seen": [probe.hooks_seen for probe in probes],
                "hooks_after": {_gradsync_hooks(p) for p in net.parameters()},
                "synced_iterations": [probe.info.get("synced_iterations") for probe in probes],
            }
    return result


@pytest.mark.timeout(60)
def test_second_fit_drops_the_first_wrappers_hooks(tmp_path: Any) -> None:
    ranks = run_distributed(_two_fits, WORLD, str(tmp_path), timeout_s=50)
    for run in ("torch", "gradsync"):
        _check_replicas_agree(ranks, run)
        _check_reference(ranks, run, atol=1e-6)
    _check_gradsync_is_torch(ranks)
    for result in ranks:
        # During each fit exactly one gradsync hook per parameter: the first fit's wrapper, discarded
        # at its teardown, reduces nothing in the second (two would all-reduce every gradient twice).
        assert result["gradsync"]["hooks_seen"] == [{1}, {1}], result["gradsync"]["hooks_seen"]
        assert result["gradsync"]["synced_iterations"] == [STEPS, STEPS]
        assert result["torch"]["hooks_seen"] == [{0}, {0}]
        # Both wrappers are garbage now, and their hooks with them.
        assert result["gradsync"]["hooks_after"] == {0}, result["gradsync"]["hooks_after"]


# ---------------------------------------------------------------------------- Fabric
def _fabric(root: str) -> dict[str, Any]:
    """Accumulate 2 micro-batches per step under fabric.no_backward_sync; save, load, reload bare."""
    rank, accumulate = dist.get_rank(), 2
    x, y = _dataset(accumulate).tensors
    result: dict[str, Any] = {"reference": _reference(_Mlp(), accumulate)}
    with _launched_externally():
        for run, strategy in NAMES.items():  # Fabric(strategy="gradsync_ddp"): GradsyncFabricDDPStrategy
            fabric = lf.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
            fabric.launch()  # processes exist already: only sets up the (existing) process group
            bare = _Mlp()
            model, optimizer = fabric.setup(bare, torch.optim.SGD(bare.parameters(), lr=LR))
            for step in range(STEPS):
                for micro in range(accumulate):
                    k = step * accumulate + micro
                    rows = slice((k * WORLD + rank) * BATCH, (k * WORLD + rank + 1) * BATCH)
                    with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                        fabric.backward(F.mse_loss(model(x[rows], k), y[rows]) / accumulate)
                optimizer.step()
                optimizer.zero_grad()
            wrapper = model._forward_module
            synced = wrapper.stats().iterations if isinstance(wrapper, GradsyncDDP) else None
            trained = _weights(bare)
            path = os.path.join(root, f"fabric_{run}.pt")
            fabric.save(path, {"model": model, "optimizer": optimizer})
            with torch.no_grad():
                for p in bare.parameters():
                    p.zero_()
            fabric.load(path, {"model": model, "optimizer": optimizer})
            fresh = _Mlp()
            state = torch.load(path, weights_only=False)["model"]
            fresh.load_state_dict(state)  # strict: no "module." prefix
            result[run] = {
                "weights": trained,
                "wrapper": f"{type(wrapper).__module__}.{type(wrapper).__qualname__}",
                "synced_iterations": synced,
                "fabric_load_restored": all(torch.equal(v, trained[k]) for k, v in _weights(bare).items()),
                "bare_load_restored": all(torch.equal(v, trained[k]) for k, v in _weights(fresh).items()),
                "saved_keys": sorted(state),
            }
    return result


@pytest.mark.timeout(60)
def test_fabric_matches_torch_ddp(tmp_path: Any) -> None:
    ranks = run_distributed(_fabric, WORLD, str(tmp_path), timeout_s=50)
    for run in ("torch", "gradsync"):
        _check_replicas_agree(ranks, run)
        _check_reference(ranks, run, atol=1e-6)
    _check_gradsync_is_torch(ranks)
    for result in ranks:
        ours = result["gradsync"]
        assert ours["wrapper"] == "gradsync.ddp.DistributedDataParallel", ours["wrapper"]
        assert ours["synced_iterations"] == STEPS  # the other STEPS backward passes ran under no_sync
        for run in ("torch", "gradsync"):
            assert result[run]["saved_keys"] == sorted(_Mlp().state_dict()), result[run]["saved_keys"]
            assert result[run]["fabric_load_restored"] and result[run]["bare_load_restored"], run


# ---------------------------------------------------------------------------- registry, one process
@pytest.mark.timeout(30)
def test_strategies_are_registered_by_name() -> None:
    trainer_strategy = pl.strategies.StrategyRegistry.get("gradsync_ddp_find_unused_parameters_true")
    assert isinstance(trainer_strategy, GradsyncDDPStrategy)
    assert trainer_strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert isinstance(lf.strategies.STRATEGY_REGISTRY.get("gradsync_ddp"), GradsyncFabricDDPStrategy)
    assert isinstance(pl.strategies.StrategyRegistry.get("ddp"), pl.strategies.DDPStrategy)
    assert not isinstance(pl.strategies.StrategyRegistry.get("ddp"), GradsyncDDPStrategy)
