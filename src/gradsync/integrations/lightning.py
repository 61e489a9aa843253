"""Lightning and Fabric strategies that train with gradsync's DistributedDataParallel.

Usage, with the arguments Lightning's ``DDPStrategy`` takes::

    from gradsync.integrations.lightning import GradsyncDDPStrategy, GradsyncFabricDDPStrategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=GradsyncDDPStrategy())
    fabric = Fabric(accelerator="cpu", devices=2, strategy=GradsyncFabricDDPStrategy())

or by name once this module is imported: ``Trainer(strategy="gradsync_ddp")``,
``Fabric(strategy="gradsync_ddp")`` (also ``gradsync_ddp_spawn``, ``gradsync_ddp_fork``,
``gradsync_ddp_notebook`` and ``gradsync_ddp_find_unused_parameters_true``).

Keyword arguments Lightning does not know (``find_unused_parameters``, ``static_graph``,
``bucket_cap_mb``, ...) go to ``gradsync.DistributedDataParallel``, as Lightning's own
strategy hands them to torch's. Each strategy overrides only where the wrapper is built
(the Trainer's also where comm hooks are registered, see below). Launching, the process
group, samplers, ``no_sync`` for gradient accumulation, manual optimization
(``reducer.prepare_for_backward``) and checkpoints without ``module.`` stay Lightning's
code, which runs unchanged because gradsync's wrapper is a torch ``DistributedDataParallel``
to ``isinstance`` and implements the private calls Lightning makes.

[Note: comm hooks on CPU]
Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA (torch 1.8's hooks
needed NCCL) and silently ignores it elsewhere. gradsync's hooks run on every backend, so
``GradsyncDDPStrategy`` registers the hook on CPU (gloo) as well.

Packages: the unified ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``)
when it is installed, else the standalone ``pytorch_lightning`` and ``lightning_fabric``.
``pl`` and ``lf`` are the modules in use: build the ``Trainer`` or ``Fabric`` from the
same package, or Lightning rejects the strategy as not its own.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ..ddp import DistributedDataParallel

if importlib.util.find_spec("lightning") is not None:
    import lightning.fabric as lf
    import lightning.pytorch as pl
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
else:
    import lightning_fabric as lf
    import pytorch_lightning as pl
    from lightning_fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning_fabric.strategies.registry import _StrategyRegistry
    from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
    from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

__all__ = ["GradsyncDDPStrategy", "GradsyncFabricDDPStrategy", "lf", "pl"]

# (registered name, start_method, find_unused_parameters or None for the default)
_NAMES: tuple[tuple[str, str, bool | None], ...] = (
    ("gradsync_ddp", "popen", None),
    ("gradsync_ddp_spawn", "spawn", None),
    ("gradsync_ddp_fork", "fork", None),
    ("gradsync_ddp_notebook", "fork", None),
    ("gradsync_ddp_find_unused_parameters_true", "popen", True),
)


def _wrap(module: nn.Module, device_ids: list[int] | None, ddp_kwargs: dict[str, Any]) -> DistributedDataParallel:
    """gradsync's wrapper, built where Lightning builds torch's (a side CUDA stream on GPUs)."""
    # https://pytorch.org/docs/stable/notes/cuda.html#id5, as in Lightning's strategies
    ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
    with ctx:
        return DistributedDataParallel(module=module, device_ids=device_ids, **ddp_kwargs)


def _register(registry: _StrategyRegistry, strategy: type, framework: str) -> None:
    for name, start_method, find_unused in _NAMES:
        kwargs: dict[str, Any] = {"start_method": start_method}
        if find_unused is not None:
            kwargs["find_unused_parameters"] = find_unused
        description = f"gradsync DistributedDataParallel under {framework}, start_method={start_method!r}" + (
            f", find_unused_parameters={find_unused}" if find_unused is not None else ""
        )
        # override=True: importing this module twice (a reload) must not fail.
        registry.register(name, strategy, description=description, override=True, **kwargs)


class GradsyncDDPStrategy(DDPStrategy):
    """Lightning ``Trainer``'s DDP strategy, training with ``gradsync.DistributedDataParallel``."""

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        return _wrap(model, self.determine_ddp_device_ids(), self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register ``ddp_comm_hook`` on every device ([Note: comm hooks on CPU])."""
        assert isinstance(self.model, DistributedDataParallel), "_register_ddp_hooks runs after _setup_model"
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """The ``gradsync_ddp*`` names (not Lightning's ``ddp*``, which the base class registers)."""
        _register(strategy_registry, cls, "Lightning")


class GradsyncFabricDDPStrategy(FabricDDPStrategy):
    """Lightning Fabric's DDP strategy, training with ``gradsync.DistributedDataParallel``."""

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        return _wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """The ``gradsync_ddp*`` names (not Fabric's ``ddp*``, which the base class registers)."""
        _register(strategy_registry, cls, "Fabric")


GradsyncDDPStrategy.register_strategies(StrategyRegistry)
GradsyncFabricDDPStrategy.register_strategies(FABRIC_REGISTRY)
