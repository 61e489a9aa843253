"""A ``gradsync.zero.ShardedOptimizer`` returned by a LightningModule's ``configure_optimizers``.

Lightning's ``DDPStrategy.setup`` wraps the module (``configure_ddp``) before it calls
``configure_optimizers`` (``setup_optimizers``), so the module reaches gradsync's wrapper as
``self.trainer.strategy.model`` and builds the sharded optimizer over it before the first forward.
``trainer.save_checkpoint`` runs on every rank and asks every rank for ``optimizer.state_dict()``
(``Strategy.optimizer_state``: the ``consolidate_state_dict`` path, rank 0 only, is for optimizers
that have that method, which ``ShardedOptimizer`` has not), so the collective ``state_dict`` works.

Each scenario fits the same module twice in the same two gloo processes under
``GradsyncDDPStrategy``: with the sharded optimizer, and with gradsync DDP + an unsharded
``torch.optim.AdamW`` (the reference); then it resumes both from their checkpoints
(``fit(ckpt_path=...)``: Lightning calls ``load_state_dict`` with the plain format on every rank).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if importlib.util.find_spec("lightning") is None:
    pytest.importorskip("pytorch_lightning")

from gradsync import DistributedDataParallel as GradsyncDDP  # noqa: E402
from gradsync.integrations.lightning import GradsyncDDPStrategy, pl  # noqa: E402
from gradsync.zero import ShardedOptimizer  # noqa: E402
from test_integration_lightning import BATCH, IN, OUT, WORLD, _launched_externally, _Mlp  # noqa: E402

from harness import run_distributed  # noqa: E402
from integration_support import quiet_cpu_trainer, run_each, scenario_ranks  # noqa: E402

STEPS = 4  # optimizer steps per fit
LR, WEIGHT_DECAY = 1e-2, 0.05
SCENARIOS = {"stage2": {"stage": 2}, "stage1": {"stage": 1}, "stage2_accumulate": {"stage": 2, "accumulate": 2}}
Weights = dict[str, torch.Tensor]


def _groups(module: torch.nn.Module) -> list[dict[str, Any]]:
    """Two param groups with different lr and weight decay."""
    head = [p for n, p in module.named_parameters() if n.startswith("mlp.head")]
    rest = [p for n, p in module.named_parameters() if not n.startswith("mlp.head")]
    return [{"params": rest}, {"params": head, "lr": LR / 2, "weight_decay": 0.0}]


class _Net(pl.LightningModule):
    def __init__(self, sharded: bool, stage: int) -> None:
        super().__init__()
        self.mlp = _Mlp()
        self.sharded, self.stage = sharded, stage
        self.wrapper_seen = ""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.mlp(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        ddp = self.trainer.strategy.model  # already gradsync's wrapper: configure_ddp ran first
        self.wrapper_seen = f"{type(ddp).__module__}.{type(ddp).__qualname__}"
        if not self.sharded:
            return torch.optim.AdamW(_groups(self), lr=LR, weight_decay=WEIGHT_DECAY)
        assert isinstance(ddp, GradsyncDDP), type(ddp)
        return ShardedOptimizer(
            ddp, torch.optim.AdamW, _groups(self), stage=self.stage, lr=LR, weight_decay=WEIGHT_DECAY
        )


def _fit(net: _Net, steps: int, accumulate: int, root: str, ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        **quiet_cpu_trainer(WORLD, root),
        strategy=GradsyncDDPStrategy(bucket_cap_mb=0.001),  # several buckets, a parameter split over ranks
        max_steps=steps,
        accumulate_grad_batches=accumulate,
    )
    g = torch.Generator().manual_seed(1)
    n = WORLD * BATCH * 2 * STEPS * accumulate  # enough for the resumed fit too
    dataset = TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, shuffle=False))
    trainer.fit(net, loader, ckpt_path=ckpt_path)
    return trainer


def _weights(net: _Net) -> Weights:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _scenario(name: str, root: str) -> dict[str, Any]:
    stage, accumulate = SCENARIOS[name]["stage"], SCENARIOS[name].get("accumulate", 1)
    result: dict[str, Any] = {}
    with _launched_externally():
        for run in ("plain", "sharded"):
            net = _Net(run == "sharded", stage)
            _fit(net, STEPS, accumulate, root)
            path = os.path.join(root, f"{name}_{run}.ckpt")
            net.trainer.save_checkpoint(path)  # every rank: the sharded optimizer's state_dict is collective
            trained = _weights(net)
            resumed = _Net(run == "sharded", stage)
            trainer = _fit(resumed, 2 * STEPS, accumulate, root, ckpt_path=path)
            result[run] = {
                "trained": trained,
                "resumed": _weights(resumed),
                "wrapper_seen": net.wrapper_seen,
                "optimizer": type(trainer.optimizers[0]).__name__,
                "checkpoint": path,
            }
    return result


def _check_checkpoint(plain_path: str, sharded_path: str) -> None:
    """The sharded run's optimizer state is torch's plain format: a bare AdamW loads it, as the reference's."""
    plain = torch.load(plain_path, weights_only=False)
    sharded = torch.load(sharded_path, weights_only=False)
    fresh = _Net(False, 2)
    fresh.load_state_dict(sharded["state_dict"])  # strict, no "module." prefix
    optimizer = torch.optim.AdamW(_groups(fresh), lr=LR, weight_decay=WEIGHT_DECAY)
    optimizer.load_state_dict(sharded["optimizer_states"][0])
    ours, theirs = optimizer.state_dict(), plain["optimizer_states"][0]
    assert ours["param_groups"] == theirs["param_groups"], (ours["param_groups"], theirs["param_groups"])
    assert ours["state"].keys() == theirs["state"].keys()
    for index, values in theirs["state"].items():
        for key, value in values.items():
            assert torch.allclose(ours["state"][index][key], value, rtol=1e-5, atol=1e-9), (index, key)


def _max_relative_difference(a: Weights, b: Weights) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("lightning_zero"))
    return run_distributed(run_each, WORLD, list(SCENARIOS), _scenario, root, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharded_optimizer_under_lightning_matches_unsharded_adamw(name: str, ranks: list[dict[str, Any]]) -> None:
    results = scenario_ranks(ranks, name)
    for rank, result in enumerate(results):
        sharded, plain = result["sharded"], result["plain"]
        assert sharded["wrapper_seen"] == "gradsync.ddp.DistributedDataParallel", sharded["wrapper_seen"]
        assert sharded["optimizer"] == "ShardedOptimizer", sharded["optimizer"]
        for when in ("trained", "resumed"):
            difference = _max_relative_difference(sharded[when], plain[when])
            assert difference <= 1e-6, f"rank {rank}, {when}: {difference:.3g} from gradsync DDP + torch AdamW"
            assert all(torch.equal(v, results[0]["sharded"][when][k]) for k, v in sharded[when].items()), rank
        assert any(not torch.equal(sharded["resumed"][k], v) for k, v in sharded["trained"].items())
    _check_checkpoint(results[0]["plain"]["checkpoint"], results[0]["sharded"]["checkpoint"])
