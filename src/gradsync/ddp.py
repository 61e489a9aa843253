"""``DistributedDataParallel``: the class users import, and the one frameworks take for torch's.

It is gradsync's wrapper (wrapper/data_parallel.py) plus torch's type and the names of torch's
class that are not public API but that code out there calls (frameworks, torch's own helpers).
Those names translate to the wrapper's and the engine's; nothing below this module knows them
(``ddp.reducer`` is the facade compat/torch_reducer.py, speaking torch's ``Reducer`` API).

[Note: a subclass of torch's DDP for its type only]
Frameworks test ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` and take
another, silently wrong, branch when it is false, so this class derives from torch's. None of
torch's code runs: the wrapper's ``__init__`` initialises ``nn.Module`` and ``Joinable``
directly, and every method and property torch's class defines is overridden here or in the
wrapper (tests/test_torch_surface.py enumerates them). Internals of torch's C++ reducer with no
counterpart raise ``NotImplementedError`` saying so, instead of failing on a missing attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from .collectives.broadcast import broadcast_coalesced
from .compat import logging_data
from .compat.torch_reducer import TorchReducer
from .compat.unsupported import torch_internal
from .engine.fused_optim import FusedOptimizer
from .engine.grad_bucket import check_comm_hook
from .engine.reducer import ReducerState
from .hooks.builtin import builtin_hook
from .wrapper import synced
from .wrapper.data_parallel import DataParallelWrapper
from .wrapper.device import move_to_device
from .wrapper.uneven_inputs import all_ranks_agree_to_sync, find_common_rank

__all__ = ["DistributedDataParallel", "TorchDDP"]


# The ignore below: the wrapper's output_device may be a torch.device, where torch's class keeps an
# int; nothing of torch's class reads it ([Note: a subclass of torch's DDP for its type only]).
class DistributedDataParallel(DataParallelWrapper, TorchDDP):  # type: ignore[misc]
    """Data-parallel training of ``module``: one process per device, gradients averaged.

    Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same arguments and methods); the
    bucketing, hooks and reductions are gradsync's own Python.
    """

    # Read by torch.compile's DDPOptimizer to split graphs at bucket boundaries. gradsync never
    # sets it: its buckets are not torch's, and its hooks run outside compiled graphs.
    _active_ddp_module = None
    _lazy_init_ran = False  # torch's flag; _lazy_init sets it

    @classmethod
    def _get_active_ddp_module(cls) -> Any:
        return cls._active_ddp_module  # always None: see above

    @property
    def reducer(self) -> TorchReducer:  # type: ignore[override]  # torch's is its C++ Reducer, an attribute
        """torch's ``Reducer`` API over the engine (compat/torch_reducer.py)."""
        return TorchReducer(self.engine)

    # ------------------------------------------------------------------ used by frameworks
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging dict (its key names, where they have a meaning here)."""
        return logging_data.collect(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError(
                "DDP runtime logging sample rate should be equal or greater than 1, got "
                f"{sample_rate}. gradsync times every iteration anyway (ddp.stats())."
            )
        self._logging_sample_rate = sample_rate

    def _remove_autograd_hooks(self) -> None:
        self.engine.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        self.engine.check_finalized()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted for torch's API: gradsync never wraps (or clones) forward outputs."""
        self._ddp_sink_clone = bool(val)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """``dist.BuiltinCommHookType.ALLREDUCE`` / ``FP16_COMPRESS`` as gradsync's Python hooks."""
        self.register_comm_hook(None, builtin_hook(comm_hook_type, self.process_group))

    def _register_fused_optim(self, optim: type, *args: Any, optim_params: Any = None, **kwargs: Any) -> None:
        """Step ``optim(params, *args, **kwargs)`` bucket by bucket as each reduction completes.

        torch's signature; [Note: stepping as buckets complete] in engine/fused_optim.py. Once per wrapper.
        """
        if self._settings.fused_optimizer is not None:
            raise RuntimeError(
                f"_register_fused_optim should only be called once on a DDP instance (rank {self.engine.rank}); "
                "pass optim_params to one registration, and step other parameters with your own optimizer."
            )
        params = [p for _, p in self._named_params]
        self._fuse_optimizer(FusedOptimizer(optim, args, kwargs, params, optim_params))

    def _update_process_group(self, new_process_group: dist.ProcessGroup) -> None:
        """Reduce over ``new_process_group`` from now on (torchft-style membership changes).

        The engine is rebuilt from scratch, buckets included, so every rank of the new group
        must call this at the same point. A registered comm hook stays; update its own
        process group separately, as with torch.
        """
        self.rebuild_engine(new_process_group)

    def _set_static_graph(self) -> None:
        engine = self.engine
        if engine.iteration > 0 or engine.state is not ReducerState.IDLE:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                f"DistributedDataParallel is constructed (rank {engine.rank}, iteration "
                f"{engine.iteration}); pass static_graph=True to the constructor instead."
            )
        self.static_graph = True
        self.rebuild_engine(static_graph=True)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Exclude the named parameters and buffers from reduction and broadcast (as torch)."""
        synced.ignore(module, params_and_buffers_to_ignore)

    @property
    def _distributed_rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _check_default_group(self) -> None:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group. That is, when you have called init_process_group and have not passed "
                "process_group argument to DDP constructor. Pickle ddp.module instead and wrap it again."
            )

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator[Any]:
        """The parameters a DDP of ``module`` manages (those not ignored), as torch yields them."""
        ignored = synced.ignored(module)
        for name, param in module.named_parameters():
            if name not in ignored and not hasattr(param, "_ddp_ignored"):
                yield (name, param) if named_params else param

    def _get_parameters(self, m: nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
        for module in m.modules() if recurse else [m]:
            yield from module.parameters(recurse=False)

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> None:
        raise err_type(err_msg)

    # ------------------------------------------------------------------ forward pieces
    @contextmanager
    def _inside_ddp_forward(self) -> Iterator[None]:
        yield  # see _active_ddp_module: nothing to announce to torch.compile

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def _lazy_init(self) -> None:
        self._setup_in_backward_optimizers()
        self._lazy_init_ran = True

    def _setup_in_backward_optimizers(self) -> None:
        if any(hasattr(p, "_in_backward_optimizers") for p in self.module.parameters()):
            raise NotImplementedError(
                "gradsync.DistributedDataParallel does not run optimizers registered with "
                "torch.distributed.optim._apply_optimizer_in_backward; step the optimizer after backward."
            )

    def _clear_grad_buffer(self) -> None:
        """Nothing to clear: gradsync keeps no gradient buffer outside its buckets."""

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> tuple[Any, Any]:
        return self.to_kwargs(inputs, kwargs, device_ids[0] if device_ids else None)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: Any) -> tuple[Any, Any]:
        """The inputs moved to the module's device, as one-element tuples (torch's legacy helper)."""
        if self.device is None:
            return (inputs,), (kwargs or {},)
        return (move_to_device(inputs, self.device),), (move_to_device(kwargs or {}, self.device),)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        """One device per process: the outputs already are where they belong."""
        return outputs

    # ------------------------------------------------------------------ buffers and join
    def _check_sync_bufs_pre_fwd(self) -> bool:
        return self.will_sync_module_buffers()

    def _check_sync_bufs_post_fwd(self) -> bool:
        return False  # no buffer comm hook runs after forward

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        return find_common_rank(input_rank, rank_cond, self.process_group, self.engine.buckets.device)

    def _default_broadcast_coalesced(
        self, bufs: list[torch.Tensor] | None = None, bucket_size: int | None = None, authoritative_rank: int = 0
    ) -> None:
        tensors = self._module_state.buffers if bufs is None else list(bufs)
        self._distributed_broadcast_coalesced(tensors, bucket_size, authoritative_rank)

    def _distributed_broadcast_coalesced(
        self, tensors: list[torch.Tensor], buffer_size: int | None, authoritative_rank: int = 0
    ) -> None:
        """Broadcast ``tensors`` from group rank ``authoritative_rank`` (one flat buffer per device)."""
        src = dist.get_global_rank(self.process_group, authoritative_rank)
        broadcast_coalesced(list(tensors), src, self.process_group)

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        self._default_broadcast_coalesced(authoritative_rank=authoritative_rank)

    def _sync_buffers(self) -> None:
        """Broadcast the buffers from rank 0, or under join from the largest still-active rank."""
        self._sync_buffers_from(candidate=True)

    def _check_and_sync_module_buffers(self) -> None:
        if self.will_sync_module_buffers():
            self._sync_buffers_from(candidate=True)

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> Any:
        wants = not is_joined_rank and self.require_backward_grad_sync
        return all_ranks_agree_to_sync(wants, self.process_group, self.engine.buckets.device)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        self.engine.shadow_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        src = self._find_common_rank(dist.get_rank(), is_last_joiner)
        self._broadcast_module_state(src, include_buffers=self.forward_sync_buffers)

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch tags its GPU SyncBatchNorm layers here; gradsync's SyncBatchNorm needs nothing."""

    def _check_comm_hook(self, hook: Callable[..., Any]) -> None:
        check_comm_hook(hook)

    # ------------------------------------------------------------------ not supported
    _register_buffer_comm_hook = torch_internal(
        "_register_buffer_comm_hook", "buffers are broadcast from rank 0 before forward (forward_sync_buffers)."
    )
    _set_sparse_metadata = torch_internal("_set_sparse_metadata", "sparse gradients are all-reduced as they are.")
    _match_unused_params_allreduce = torch_internal(
        "_match_unused_params_allreduce", "joined ranks mirror the used map in _match_all_reduce_for_bwd_pass."
    )
    _register_accum_grad_hook = torch_internal("_register_accum_grad_hook", "gradsync's reducer hooks every parameter.")
    _delayed_all_reduce_hook = torch_internal(
        "_delayed_all_reduce_hook", "delay_all_reduce_named_params is handled by gradsync's reducer."
    )
    _register_delay_all_reduce_hook = torch_internal(
        "_register_delay_all_reduce_hook", "pass delay_all_reduce_named_params to the constructor."
    )
    _fire_reducer_autograd_hook = torch_internal(
        "_fire_reducer_autograd_hook", "gradients reach the reducer by themselves."
    )
    _root_copy_hook = torch_internal("_root_copy_hook", "mixed_precision casts in gradsync's forward.")
    _module_wait_for_copy_hook = torch_internal(
        "_module_wait_for_copy_hook", "mixed_precision casts in gradsync's forward."
    )
    _ddp_init_helper = torch_internal("_ddp_init_helper", "construct DistributedDataParallel again instead.")
    _build_params_for_reducer = torch_internal("_build_params_for_reducer", "see gradsync.wrapper.synced.parameters.")
    _assign_modules_buffers = torch_internal("_assign_modules_buffers", "see gradsync.wrapper.synced.buffers.")
    _build_debug_param_to_name_mapping = torch_internal(
        "_build_debug_param_to_name_mapping", "gradsync's errors always name parameters."
    )
