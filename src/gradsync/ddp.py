"""``DistributedDataParallel``: the ``nn.Module`` wrapper users import.

It owns the user-facing contract (torch 2.13's constructor and methods); the gradient
work happens in ``reducer.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from .collectives.broadcast import broadcast_coalesced
from .collectives.same_model import verify_same_parameters
from .compat.torch_surface import TorchDDPSurface
from .engine import errors
from .engine.grad_bucket import check_comm_hook
from .engine.reducer import Reducer, ReducerState
from .observability import liveness
from .observability.desync import DesyncDetector, Position
from .observability.divergence import DivergenceCheck
from .observability.labels import label
from .observability.stats import DDPStats, collect_stats
from .observability.timing import now
from .sync_batchnorm import SyncBatchNorm
from .wrapper import options, synced, watch
from .wrapper.bucket_caps import auto_bucket_caps, default_bucket_caps, prefers_few_buckets, torch_default_caps
from .wrapper.device import move_to_device
from .wrapper.mixed_precision import MixedPrecision
from .wrapper.uneven_inputs import JoinableDDP, all_ranks_agree_to_sync, find_common_rank

logger = logging.getLogger(__name__)


class DistributedDataParallel(TorchDDPSurface, JoinableDDP, TorchDDP):
    """Data-parallel training of ``module``: one process per device, gradients averaged.

    Drop-in for ``torch.nn.parallel.DistributedDataParallel`` (same arguments and
    methods); the bucketing, hooks and reductions are gradsync's own Python.

    [Note: a subclass of torch's DDP for its type only]
    Frameworks test ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` and take
    another, silently wrong, branch when it is false, so this class derives from torch's. None
    of torch's code runs: ``__init__`` initialises ``nn.Module`` and ``Joinable`` directly, and
    every method and property torch's class defines is overridden here, in ``TorchDDPSurface``
    or in ``JoinableDDP`` (tests/test_torch_surface.py enumerates them).
    """

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
        nn.Module.__init__(self)  # not torch's DDP __init__: see the class note
        Joinable.__init__(self)
        self._join_divide_by_initial_world_size = True
        options.warn_deprecated(check_reduction)
        self.process_group = options.resolve_process_group(process_group, device_mesh)
        self.module = module
        named_params = synced.parameters(module)
        options.check_parameters(module, named_params)
        self.device = options.resolve_device(device_ids, output_device, named_params)
        self.device_ids = None if self.device is None else [self.device.index]
        self.output_device = None if self.device is None else (output_device or self.device)
        self.dim, self._caps_cut_for_link = dim, False  # the latter: the default's caps are for a slow link
        caps = options.resolve_caps(bucket_cap_mb, bucket_cap_mb_list)
        total = sum(p.numel() * p.element_size() for _, p in named_params)
        if caps is None:  # "auto": sized from this group's measured all-reduce cost
            caps = auto_bucket_caps(self.process_group, named_params[0][1].device, total)
        init_sync_buffers, self.forward_sync_buffers = options.resolve_buffer_sync(
            broadcast_buffers, forward_sync_buffers
        )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        # gradsync always copies one batched op per bucket (torch's batched_grad_copy): a no-op flag.
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.mixed_precision = mixed_precision
        self._mixed_precision = None
        if mixed_precision is not None:  # casts the buffers, so before they are listed and broadcast
            self._mixed_precision = MixedPrecision(mixed_precision, module, synced.ignored(module))
        self._synced_buffers = synced.buffers(module)
        # Modules that communicate inside forward cannot be shadowed by joined ranks.
        self._forward_collectives = [n for n, m in module.named_modules() if isinstance(m, SyncBatchNorm)]
        self._trainable = [p for _, p in module.named_parameters()]
        self._trainable_flags = [p.requires_grad for p in self._trainable]
        self._named_params = named_params
        if init_sync:
            verify_same_parameters(named_params, self.process_group)
            self._broadcast_module_state(self._authoritative_rank(), include_buffers=init_sync_buffers)
            if bucket_cap_mb is None and bucket_cap_mb_list is None:  # after the check: every rank agrees on total
                caps = default_bucket_caps(self.process_group, named_params[0][1].device, total)
                self._caps_cut_for_link = caps != torch_default_caps()
        sparse = synced.sparse_flags(module, named_params)
        delayed, delay_after = options.resolve_delayed(
            named_params, sparse, delay_all_reduce_named_params, param_to_hook_all_reduce
        )
        reduce_dtype = None if self._mixed_precision is None else self._mixed_precision.reduce_dtype
        options.check_reduce_dtype(reduce_dtype, named_params, gradient_as_bucket_view)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self._reducer_config = {
            "sparse": sparse,
            "caps": caps,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
            "delayed": delayed,
            "delay_after": delay_after,
            "reduce_dtype": reduce_dtype,
        }
        self.reducer = self._make_reducer()
        liveness.start_responder()  # lets survivors of a crash name the dead rank
        self._added_after_wrapping: list[str] = []
        watch.watch(module, self._on_module_changed)
        self._divergence: DivergenceCheck | None = None
        self._logged_error: str | None = None
        self._lazy_init_ran = False
        if os.environ.get("GRADSYNC_DEBUG", "").lower() in ("desync", "detail"):
            self.enable_desync_detection()

    def _make_reducer(self) -> Reducer:
        config = dict(self._reducer_config)
        reducer = Reducer(self._named_params, config.pop("sparse"), self.process_group, config.pop("caps"), **config)
        reducer.fused_optimizer = getattr(self, "_fused_optimizer", None)  # set by _register_fused_optim
        return reducer

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Exclude the named parameters and buffers from reduction and broadcast (as torch)."""
        synced.ignore(module, params_and_buffers_to_ignore)

    def _authoritative_rank(self) -> int:
        return dist.get_global_rank(self.process_group, 0)

    def _broadcast_module_state(self, src: int, include_buffers: bool) -> None:
        state = [p.detach() for _, p in self._named_params]
        if include_buffers:
            state += self._synced_buffers
        broadcast_coalesced(state, src, self.process_group)

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        if self._mixed_precision is not None:
            output = self._mixed_precision.run(self.module, inputs, kwargs)
        else:
            output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    @torch.compiler.disable
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Everything before the wrapped module runs; inputs moved to the module's device.

        Kept out of ``torch.compile`` graphs (as are ``_post_forward`` and the gradient hooks): a
        compiled wrapper compiles the module's forward and runs the synchronisation eagerly.
        """
        with label("gradsync::forward"):
            self._forward_start = now()
            if self.reducer.retired:
                raise RuntimeError(errors.wrapper_replaced(self.reducer.rank))
            self.reducer.phase = "forward"
            grad_enabled = torch.is_grad_enabled()
            will_sync = grad_enabled and self.require_backward_grad_sync
            if grad_enabled:
                self._check_trainable_unchanged()
            if self._divergence is not None and will_sync and not self._join_config.enable:
                self._divergence.maybe_check(self.reducer.synced_forwards + 1)
            if self._join_config.enable and self._forward_collectives:
                self._check_join_allows_forward_collectives()
            still_active = Join.notify_join_context(self)  # None unless inside an enabled join
            if still_active is not None and not self._join_divide_by_initial_world_size:
                self.reducer.divide_by_active_ranks(still_active.get_future())
            if grad_enabled:
                self.reducer.prepare_for_forward()
            self._sync_start = self._sync_end = 0.0
            if self.will_sync_module_buffers():
                self._sync_start = now()
                self._sync_buffers(candidate=True)
                self._sync_end = now()
            if self._join_config.enable:
                all_ranks_agree_to_sync(will_sync, self.process_group, self.reducer.buckets.device)
            if self.device is not None:
                inputs = move_to_device(inputs, self.device)
                kwargs = move_to_device(kwargs, self.device)
            if self._mixed_precision is not None:
                inputs, kwargs = self._mixed_precision.cast_inputs(inputs, kwargs)
            return inputs, kwargs

    @torch.compiler.disable
    def _post_forward(self, output: Any) -> Any:
        """Arm the reducer for the backward through ``output`` (or not, under ``no_sync``).

        ``require_backward_grad_sync`` is read again here, after the module ran: Lightning's
        manual optimization clears it from inside the forward and arms the reducer itself
        (``reducer.prepare_for_backward``), as torch's DDP allows.
        """
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            forward_end = now()
            self.reducer.prepare_for_backward(output)
            times = self.reducer.times
            times.forward_start, times.forward_end = self._forward_start, forward_end
            times.buffer_sync_start, times.buffer_sync_end = self._sync_start, self._sync_end
        else:
            self.require_forward_param_sync = False
            if grad_enabled:
                # A no_sync forward: its backward accumulates locally. A no-grad forward
                # builds no graph, so a pending synced backward stays armed.
                self.reducer.skip_backward()
        return output

    def will_sync_module_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._synced_buffers)

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _sync_buffers(self, candidate: bool) -> None:
        """Broadcast buffers from rank 0, or under join from the largest still-active rank."""
        with label("gradsync::sync_buffers"):
            if self.reducer.desync is not None:
                numel = sum(b.numel() for b in self._synced_buffers)
                what = "buffer broadcast"
                self.reducer.desync.check(Position(what, self.reducer.synced_forwards + 1, numel, "mixed"))
            if self._join_config.enable:
                src = find_common_rank(dist.get_rank(), candidate, self.process_group, self.reducer.buckets.device)
            else:
                src = self._authoritative_rank()
            # A buffer saved for backward (e.g. by an eval-mode BatchNorm) is overwritten
            # with equal values on the source rank; keep autograd's version check quiet.
            self.reducer.phase = "the buffer broadcast before forward"
            if self.reducer.keep_local and self.reducer.failures:
                return  # fault-tolerant mode: this step failed already ([Note: a step is decided before it is written])
            try:
                with synced.preserve_version_counters(self._synced_buffers):
                    broadcast_coalesced(self._synced_buffers, src, self.process_group)
            except RuntimeError as error:
                if self.reducer.keep_local:
                    self.reducer.failures.append(f"the buffer broadcast failed: {error}")
                    return
                raise RuntimeError(self.reducer.collective_failure_message(str(error))) from error

    def _on_module_changed(self, module: nn.Module, name: str) -> None:
        prefix = next((n for n, m in self.module.named_modules() if m is module), "?")
        self._added_after_wrapping.append(f"{prefix}.{name}" if prefix else name)

    def _check_trainable_unchanged(self) -> None:
        if self._added_after_wrapping:
            added = self._added_after_wrapping
            raise RuntimeError(
                f"Parameters or submodules {added} were added to (or replaced in) the module after it was "
                f"wrapped in DistributedDataParallel (rank {self.reducer.rank}); their gradients would never be "
                "synchronised. Build the complete model before wrapping it, or wrap it again."
            )
        flags = [p.requires_grad for p in self._trainable]
        if flags == self._trainable_flags:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        changed = [
            names.get(id(p), "?") for p, old, new in zip(self._trainable, self._trainable_flags, flags) if old != new
        ]
        raise RuntimeError(
            f"requires_grad changed on parameters {changed} after they were wrapped in "
            f"DistributedDataParallel (rank {self.reducer.rank}). The buckets were built for the old "
            "set and would train silently wrong. Freeze or unfreeze layers before wrapping, or wrap "
            "the model again after changing requires_grad."
        )

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

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's contract)."""
        try:
            self._check_can_register(hook)
        except (TypeError, ValueError, RuntimeError) as error:
            self._logged_error = str(error)  # torch's logging data reports the last error
            raise
        self.reducer.register_comm_hook(state, hook)
        if self._caps_cut_for_link and prefers_few_buckets(state):  # [Note: caps under a compressing hook]
            self.reducer.caps = torch_default_caps()  # the rebuild after iteration 0 uses them

    def _check_can_register(self, hook: Callable[..., Any]) -> None:
        check_comm_hook(hook)
        if self.reducer.comm_hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. A comm hook "
                f"({self.reducer.hook_name}) is already registered on this DistributedDataParallel (rank "
                f"{self.reducer.rank}); compose hooks inside one function instead."
            )
        if self.reducer.iteration > 0 or self.reducer.state is not ReducerState.IDLE:
            raise RuntimeError(
                f"register_comm_hook was called after training started (rank {self.reducer.rank}, "
                f"iteration {self.reducer.iteration}); register the hook before the first forward."
            )

    # ------------------------------------------------------------------ observability
    def stats(self) -> DDPStats:
        """Buckets, per-iteration timing averages, bytes reduced, unused parameters, hook."""
        return collect_stats(
            self.reducer,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def enable_divergence_check(self, every: int = 100, include_buffers: bool = True) -> None:
        """Every ``every`` synced forwards, raise if parameters (and buffers) differ across ranks.

        Costs one pass over the model and one small all-gather per check (see ``debug.py``).
        """
        named = [(n, p) for n, p in self._named_params]
        if include_buffers:
            names = {id(b): n for n, b in self.module.named_buffers()}
            named += [(names.get(id(b), "buffer"), b) for b in self._synced_buffers]
        self._divergence = DivergenceCheck(every, named, self.process_group)

    def enable_desync_detection(self, timeout_s: float = 60.0) -> None:
        """Debug mode: ranks agree on every collective before issuing it (see ``debug.py``).

        Also switched on by the environment variable ``GRADSYNC_DEBUG=desync``.
        """
        self.reducer.desync = DesyncDetector(self.process_group, timeout_s)

    def _set_static_graph(self) -> None:
        if self.reducer.iteration > 0 or self.reducer.state is not ReducerState.IDLE:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                f"DistributedDataParallel is constructed (rank {self.reducer.rank}, iteration "
                f"{self.reducer.iteration}); pass static_graph=True to the constructor instead."
            )
        self.static_graph = True
        self._reducer_config["static_graph"] = True
        self.reducer.remove_hooks()
        self.reducer = self._make_reducer()

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
        # Autograd hook handles and the group are per-process; they are rebuilt on load.
        del state["process_group"], state["reducer"]
        state["_divergence"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        self.process_group = dist.group.WORLD
        self.reducer = self._make_reducer()
        watch.watch(self.module, self._on_module_changed)

    def train(self, mode: bool = True) -> DistributedDataParallel:
        nn.Module.train(self, mode)
        return self
