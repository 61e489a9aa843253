"""``DataParallelWrapper``: the ``nn.Module`` wrapper, in gradsync's own terms.

It owns the user-facing contract of torch 2.13's DDP (constructor, ``forward``, ``no_sync``,
``register_comm_hook``, ``join``) and gradsync's additions (``stats``, divergence and desync
checks); the gradient work happens in the engine it holds (``self.engine``, engine/reducer.py).
``gradsync.DistributedDataParallel`` (ddp.py) is this class plus torch's type and the private
names frameworks call.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..collectives.same_model import verify_same_parameters
from ..engine import errors
from ..engine.fused_optim import FusedOptimizer
from ..engine.grad_bucket import check_comm_hook
from ..engine.reduce_scatter import ReduceScatter
from ..engine.reducer import Reducer, ReducerState
from ..engine.reductions import hook_name
from ..hooks.shardable import shard_wire_dtype
from ..observability import liveness
from ..observability.labels import label
from ..observability.stats import DDPStats
from ..observability.timing import now
from ..observability.trace import Timeline
from ..sync_batchnorm import SyncBatchNorm
from . import options, synced, uneven_inputs
from .agreement_checks import AgreementChecks
from .bucket_caps import starting_caps
from .device import move_to_device
from .engine_settings import EngineSettings
from .guard import ParameterGuard
from .mixed_precision import MixedPrecision
from .module_state import ModuleState


class DataParallelWrapper(nn.Module, Joinable):
    """Data-parallel training of ``module``: one process per device, gradients averaged."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not torch's DDP __init__ ([Note: a subclass of torch's DDP ...] in ddp.py)
        Joinable.__init__(self)
        options.warn_deprecated(check_reduction)
        self.process_group = options.resolve_process_group(process_group, device_mesh)
        self.module = module
        named_params = synced.parameters(module)
        options.check_parameters(module, named_params)
        self._named_params = named_params
        self.device = options.resolve_device(device_ids, output_device, named_params)
        self.device_ids = None if self.device is None else [self.device.index]
        self.output_device = None if self.device is None else (output_device or self.device)
        self.dim = dim
        init_sync_buffers, self.forward_sync_buffers = options.resolve_buffer_sync(
            broadcast_buffers, forward_sync_buffers
        )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        # gradsync always copies one batched op per bucket (torch's batched_grad_copy): a no-op flag.
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.mixed_precision = mixed_precision
        self._mixed_precision = None
        if mixed_precision is not None:  # casts the buffers, so before they are listed and broadcast
            self._mixed_precision = MixedPrecision(mixed_precision, module, synced.ignored(module))
        self._module_state = ModuleState([p for _, p in named_params], synced.buffers(module))
        # Modules that communicate inside forward cannot be shadowed by joined ranks.
        self._forward_collectives = [n for n, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
        self._guard = ParameterGuard(module)
        self._join_divide_by_initial_world_size = True
        self._checks = AgreementChecks(self.process_group)  # divergence and desync, when switched on
        self._logged_error: str | None = None  # torch's logging data reports the last error
        caps = options.resolve_caps(bucket_cap_mb, bucket_cap_mb_list)  # None: "auto"
        if init_sync:
            verify_same_parameters(named_params, self.process_group)
            self._broadcast_module_state(self._authoritative_rank(), include_buffers=init_sync_buffers)
        user_chose = bucket_cap_mb is not None or bucket_cap_mb_list is not None
        total = sum(p.numel() * p.element_size() for _, p in named_params)
        caps, default_caps_on_cpu = starting_caps(
            caps, user_chose, init_sync, self.process_group, named_params[0][1].device, total
        )
        # what every engine gets, the first and any rebuilt one ([Note: what a rebuilt engine keeps])
        self._settings = EngineSettings(self._checks, default_caps_on_cpu)
        reduce_dtype = None if self._mixed_precision is None else self._mixed_precision.reduce_dtype
        self._config = options.reducer_config(
            module,
            named_params,
            caps,
            delay_all_reduce_named_params,
            param_to_hook_all_reduce,
            reduce_dtype,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
        )
        self.engine = self._build_engine()
        liveness.start_responder()  # lets survivors of a crash name the dead rank
        if os.environ.get("GRADSYNC_DEBUG", "").lower() in ("desync", "detail"):
            self.enable_desync_detection()

    def _build_engine(self, previous: Reducer | None = None) -> Reducer:
        engine = Reducer(self._named_params, self.process_group, self._config)
        return self._settings.apply(engine, previous)  # [Note: what a rebuilt engine keeps]

    def rebuild_engine(self, process_group: dist.ProcessGroup | None = None, **changes: Any) -> None:
        """A fresh reducer (buckets included) over ``process_group``, or with ``ReducerConfig`` changes.

        A registered comm hook stays (update its own process group separately, as with torch).
        Every rank of the group must call this at the same point.
        """
        if process_group is not None:
            self.process_group = process_group
            self._checks.follow(process_group)
        if changes:
            self._config = dataclasses.replace(self._config, **changes)
        self.engine = self._build_engine(self.engine)  # it takes the parameters' hooks over from the old one

    def _authoritative_rank(self) -> int:
        return dist.get_global_rank(self.process_group, 0)

    def _broadcast_module_state(self, src: int, include_buffers: bool) -> None:
        self._module_state.broadcast(src, self.process_group, include_buffers)

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        if self._mixed_precision is not None:
            output = self._mixed_precision.run(self.module, inputs, kwargs)
        else:
            output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # torch's decorator has no annotations
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Everything before the wrapped module runs; inputs moved to the module's device.

        Kept out of ``torch.compile`` graphs (as are ``_post_forward`` and the gradient hooks): a
        compiled wrapper compiles the module's forward and runs the synchronisation eagerly.
        """
        with label("gradsync::forward"):
            self._forward_start = now()
            engine = self.engine
            if engine.retired:
                raise RuntimeError(errors.wrapper_replaced(engine.rank))
            engine.phase = "forward"
            grad_enabled = torch.is_grad_enabled()
            will_sync = grad_enabled and self.require_backward_grad_sync
            if grad_enabled:
                self._guard.check(engine.rank)
            if will_sync and not self._join_config.enable:
                self._checks.before_synced_forward(engine.synced_forwards + 1)
            if self._join_config.enable:
                uneven_inputs.check_forward_collectives(
                    self._forward_collectives, self._join_config.throw_on_early_termination
                )
            still_active = Join.notify_join_context(self)  # None unless inside an enabled join
            if still_active is not None and not self._join_divide_by_initial_world_size:
                engine.divisor.follow_active_ranks(still_active.get_future())
            if grad_enabled:
                engine.before_forward()
            self._sync_start = self._sync_end = 0.0
            if self.will_sync_module_buffers():
                self._sync_start = now()
                self._sync_buffers_from(candidate=True)
                self._sync_end = now()
            if self._join_config.enable:
                uneven_inputs.all_ranks_agree_to_sync(will_sync, self.process_group, engine.buckets.device)
            if self.device is not None:
                inputs = move_to_device(inputs, self.device)
                kwargs = move_to_device(kwargs, self.device)
            if self._mixed_precision is not None:
                inputs, kwargs = self._mixed_precision.cast_inputs(inputs, kwargs)
            return inputs, kwargs

    @torch.compiler.disable  # type: ignore[untyped-decorator]  # as above
    def _post_forward(self, output: Any) -> Any:
        """Arm the engine for the backward through ``output`` (or not, under ``no_sync``).

        ``require_backward_grad_sync`` is read again here, after the module ran: Lightning's
        manual optimization clears it from inside the forward and arms the reducer itself
        (``reducer.prepare_for_backward``), as torch's DDP allows.
        """
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            forward_end = now()
            self.engine.arm(output)
            times = self.engine.current.times
            times.forward_start, times.forward_end = self._forward_start, forward_end
            times.buffer_sync_start, times.buffer_sync_end = self._sync_start, self._sync_end
        else:
            self.require_forward_param_sync = False
            if grad_enabled:
                # A no_sync forward: its backward accumulates locally. A no-grad forward
                # builds no graph, so a pending synced backward stays armed.
                self.engine.disarm()
        return output

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._module_state.buffers)

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _sync_buffers_from(self, candidate: bool) -> None:
        """Broadcast buffers from rank 0, or under join from the largest rank that is a ``candidate``."""

        def source() -> int:
            if not self._join_config.enable:
                return self._authoritative_rank()
            device = self.engine.buckets.device
            return uneven_inputs.find_common_rank(dist.get_rank(), candidate, self.process_group, device)

        self._module_state.sync_buffers(self.engine, self.process_group, source)

    # ------------------------------------------------------------------ user API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synced backward afterwards averages them.

        The *forward* must run inside the context (as with torch's DDP).
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future[Any]]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's contract)."""
        try:
            self._check_can_register(hook)
            if isinstance(self.engine.reduction, ReduceScatter):  # a sharded optimizer sends shards: a cast only
                name = hook_name(hook)
                self.engine.reduction.compress(hook, state, name, shard_wire_dtype(hook, name, self.engine.rank))
                return
        except (TypeError, ValueError, RuntimeError) as error:
            self._logged_error = str(error)
            raise
        self.engine.register_comm_hook(state, hook)
        self._settings.caps_for_hook(self.engine, state)

    def _check_can_register(self, hook: Callable[..., Any]) -> None:
        check_comm_hook(hook)
        engine = self.engine
        if engine.reduction.hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. A comm hook "
                f"({engine.reduction.name}) is already registered on this DistributedDataParallel (rank "
                f"{engine.rank}); compose hooks inside one function instead."
            )
        if engine.iteration > 0 or engine.state is not ReducerState.IDLE:
            raise RuntimeError(
                f"register_comm_hook was called after training started (rank {engine.rank}, "
                f"iteration {engine.iteration}); register the hook before the first forward."
            )

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for ranks with different numbers of batches (wrapper/uneven_inputs.py).

        Ranks that run out of data shadow the collectives of those still training; with
        ``divide_by_initial_world_size=False`` gradients are averaged over the ranks still
        active instead of the whole group. A sharded optimizer over this wrapper joins with it.
        """
        partner = self.engine.reduction.join_partner
        joinables = [self] if partner is None else [self, partner]
        return Join(
            joinables, enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        engine = self.engine
        skip, desync = self.skip_all_reduce_unused_params, engine.desync is not None
        uneven_inputs.check_can_join(skip, desync)
        self._join_divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return uneven_inputs.DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.engine.buckets.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _fuse_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Step ``optimizer`` bucket by bucket as each reduction completes (engine/fused_optim.py)."""
        if isinstance(self.engine.reduction, ReduceScatter):
            raise NotImplementedError(
                "_register_fused_optim cannot be combined with a sharded optimizer (gradsync.zero.ShardedOptimizer), "
                f"which steps the shards itself (rank {self.engine.rank}); use one of the two."
            )
        self._settings.fused_optimizer = optimizer
        self.engine.fused_optimizer = optimizer

    # ------------------------------------------------------------------ observability
    def stats(self) -> DDPStats:
        """Buckets, per-iteration timing averages, bytes reduced, unused parameters, hook."""
        return self.engine.stats()

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Where ``gradsync.trace`` collects this rank's timeline (None: not tracing)."""
        self._settings.timeline = timeline
        self.engine.records.timeline = timeline

    def enable_divergence_check(self, every: int = 100, include_buffers: bool = True) -> None:
        """Every ``every`` synced forwards, raise if parameters (and buffers) differ across ranks.

        Costs one pass over the model and one small all-gather per check (observability/divergence.py).
        """
        named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in self._named_params]
        if include_buffers:
            names = {id(b): n for n, b in self.module.named_buffers()}
            named += [(names.get(id(b), "buffer"), b) for b in self._module_state.buffers]
        self._checks.enable_divergence(every, named)

    def enable_desync_detection(self, timeout_s: float = 60.0) -> None:
        """Debug mode: ranks agree on every collective before issuing it (observability/desync.py).

        Also switched on by the environment variable ``GRADSYNC_DEBUG=desync``.
        """
        if self.engine.tolerance.enabled:  # the fault-tolerant mode's engine keeps local gradients
            raise ValueError(errors.desync_under_fault_tolerance(self.engine.rank))
        self._checks.enable_desync(timeout_s)
        self.engine.desync = self._checks.desync

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group. That is, when you have called init_process_group and have not passed "
                "process_group argument to DDP constructor. A process group cannot be pickled: pickle "
                "ddp.module instead and wrap the copy again."
            )
        state = self.__dict__.copy()
        # Autograd hook handles and the group are per-process; they are rebuilt on load (the checks off).
        del state["process_group"], state["engine"], state["_checks"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self.process_group = cast(dist.ProcessGroup, dist.group.WORLD)
        self._checks = AgreementChecks(self.process_group)
        self._settings.checks = self._checks
        self.engine = self._build_engine()
        self._guard.watch()

    def train(self, mode: bool = True) -> DataParallelWrapper:
        nn.Module.train(self, mode)
        return self
