"""The reducer: turns per-parameter gradients into averaged gradients, bucket by bucket.

Glossary
--------
parameter      a tensor of the wrapped module that requires grad, known by its index
               (registration order) and its name.
``.grad``      the gradient autograd accumulates on the parameter.
flat bucket    one 1-D tensor holding the gradients of several parameters back to back
               (``BucketStorage.flat``); it is what one collective reduces.
bucket view    a view of the flat bucket shaped like one parameter.
ready          a parameter is ready once autograd has finished accumulating its ``.grad``
               for this backward (a post-accumulate-grad hook tells us).
launched       a bucket whose collective (or comm hook) has been started.
finalized      every launched bucket has been waited for and its result written to ``.grad``.

Lifecycle per iteration: ``prepare_for_forward`` → ``prepare_for_backward`` →
``mark_ready`` (per parameter, from autograd) → ``launch`` (per bucket, strictly in
index order) → ``finalize`` (once, at the end of backward).

[Note: launch order]
A bucket whose parameters are all ready is launched only after every bucket before it
was launched. Gradients may become ready in a different order on each rank; launching
in index order makes every rank issue the same sequence of collectives anyway.

[Note: end-of-backward callback]
``finalize`` runs as an autograd-engine callback queued on the *outermost* backward. A
pre-hook on the autograd nodes that produced the forward's outputs queues it: those
nodes run first in a backward through the outputs, before reentrant checkpointing can
start nested backwards (whose own callbacks would finish too early). If a parameter
hook fires before any output node (a parameter used outside forward), it queues the
callback itself, still on the outer backward.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..compat.torch_surface import TorchReducerSurface
from ..observability.desync import DesyncDetector
from ..observability.labels import label
from ..observability.timing import IterationTimes, RunningStats, now
from . import errors, graph, launch, ownership
from .bucket_set import BucketSet
from .fused_optim import FusedOptimizer
from .launch import CommHook, LaunchesBuckets, finish_hook_launches
from .rebuild import BucketRebuild, RebuildsBuckets
from .reducer_reports import ReducerReports
from .static_graph import StaticGraphCounts
from .tolerant import TolerantReduction

logger = logging.getLogger(__name__)


class ReducerState(enum.Enum):
    IDLE = "idle"  # no synced forward is waiting for its backward; hooks only note usage
    ARMED = "armed"  # a synced forward ran; its backward has not started yet
    REDUCING = "reducing"  # a synced backward is running: buckets are being launched
    FINALIZED = "finalized"  # averaged gradients of the last synced forward are in .grad


class Reducer(TorchReducerSurface, LaunchesBuckets, TolerantReduction, ReducerReports, RebuildsBuckets):
    """Buckets, readiness tracking and reduction for one wrapped module."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        sparse: list[bool],
        process_group: dist.ProcessGroup,
        caps: list[int],
        *,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool,
        skip_all_reduce_unused_params: bool = False,
        delayed: frozenset[int] = frozenset(),
        delay_after: int | None = None,
        reduce_dtype: torch.dtype | None = None,
        keep_local_grads: bool = False,
    ) -> None:
        """``keep_local_grads``: the fault-tolerant mode's reduction ([Note: a step is decided before
        it is written] in elastic/fault_tolerant.py); see ``TolerantReduction``."""
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.as_view = gradient_as_bucket_view
        self.caps = caps
        self.sparse = sparse
        # Initial order: reverse registration, since later layers get gradients first.
        # Reducing lone large gradients in place needs no hook; hooks are registered after
        # construction, so the rebuild decides again.
        self.buckets = BucketSet(
            self.params,
            sparse,
            list(reversed(range(len(self.params)))),
            caps,
            reduce_lone_in_place=not keep_local_grads,
            delayed=delayed,
            reduce_dtype=reduce_dtype,
            delay_after=delay_after,
        )
        # torch's contract: the unused set is the same on every rank, so every rank skips the same buckets.
        self.skip_unused = skip_all_reduce_unused_params
        self._known_unused: set[int] = set()
        self.initial_bucket_sizes = [s.nbytes for s in self.buckets.storages]
        self.comm_hook: CommHook | None = None
        self.fused_optimizer: FusedOptimizer | None = None  # ddp._register_fused_optim
        self.comm_hook_state: Any = None
        self.state = ReducerState.IDLE
        self.iteration = 0  # synced backwards finalized so far
        self._rebuild = BucketRebuild(len(self.params), enabled=static_graph or not find_unused_parameters)
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        self._used_since_sync = [False] * len(self.params)
        self._forward_unused: set[int] | None = None
        self._static = StaticGraphCounts(len(self.params))
        self._output_hook_handles: list[Any] = []
        self._callback_queued = False
        # Under join with divide_by_initial_world_size=False, the forward's "still active"
        # all-reduce tells how many ranks contribute; resolved at the first launch.
        self._active_ranks_future: Any = None
        self._divisor: float = float(self.world_size)
        self.synced_forwards = 0  # every rank counts the same; desync checks compare it
        self.running = RunningStats()
        self.timeline: Any = None  # a trace.Timeline while tracing
        self.desync: DesyncDetector | None = None
        self.phase = "construction"  # named in errors when a collective fails
        self._warned_nothing_unused = False
        # can_set_static_graph: the same parameters unused in every synced iteration so far.
        self.graph_static = True
        self._last_unused: tuple[int, ...] | None = None
        self._never_used: list[bool] | None = None  # static_graph: used on some rank in iteration 0
        self.retired = False  # replaced by a newer reducer of the same parameters
        self.last_error: str | None = None  # torch's logging data reports it as "error"
        self._init_tolerance(keep_local_grads)
        self._reset_iteration()
        self._grad_hooks = ownership.GradHooks(self, self.params)
        for previous in ownership.claim(self, self.params):
            previous.retire()

    # ------------------------------------------------------------------ lifecycle
    def _reset_iteration(self) -> None:
        n = len(self.params)
        self._ready = [False] * n
        self._static.reset()
        self._marked_unused: set[int] = set()
        self._pending = [len(b.params) for b in self.buckets.storages]
        self._next_bucket = 0
        self._results: list[Any] = []
        self._errors: list[str | Exception] = []
        self._known_unused = set()
        self._divisor = self.fixed_divisor or float(self.world_size)
        self.times = IterationTimes(len(self.buckets.storages))
        self.buckets.begin_iteration()

    def prepare_for_forward(self) -> None:
        """Called before every grad-enabled forward: check the last backward, rebuild once."""
        if self.state is ReducerState.REDUCING:
            raise RuntimeError(errors.backward_never_finished(self.rank, self.iteration))
        self._rebuild_buckets()

    def prepare_for_backward(self, output: Any) -> None:
        """After a synced forward: expect the next backward through ``output`` to reduce.

        Also torch's ``Reducer.prepare_for_backward(tensors)``, which frameworks call to arm a
        backward whose forward ran unsynced (Lightning's manual optimization, Accelerate's
        ``trigger_sync_in_backward``). With no tensors nothing tells which parameters the coming
        backward uses; with ``find_unused_parameters`` those that report nothing by the end of it
        count as unused.
        """
        for handle in self._output_hook_handles:
            handle.remove()
        roots = graph.output_grad_fns(output)
        self._output_hook_handles = [node.register_prehook(self._on_output_backward) for node in roots]
        if self.find_unused and not self.static_graph and not roots:
            self._forward_unused = None
        elif self.find_unused and not self.static_graph:
            reached = graph.reachable_leaves(roots)
            unused = {i for i, p in enumerate(self.params) if id(p) not in reached}
            # Several forwards before one backward: a parameter used by any of them is used.
            if self.state is ReducerState.ARMED and self._forward_unused is not None:
                unused &= self._forward_unused
            self._forward_unused = unused
        self.state = ReducerState.ARMED
        self.synced_forwards += 1
        self._reset_iteration()

    def divide_by_active_ranks(self, still_active: Any) -> None:
        """Average over the ranks still training (join), not the whole group."""
        self._active_ranks_future = still_active

    def _take_divisor(self) -> float:
        if self._active_ranks_future is not None:
            count = self._active_ranks_future.wait()
            count = count[0] if isinstance(count, list) else count
            self._divisor = float(count.item())
            self._active_ranks_future = None
        return self._divisor

    def skip_backward(self) -> None:
        """After a forward that must not sync (``no_sync`` or no grad)."""
        if self.state is ReducerState.ARMED:
            self.state = ReducerState.IDLE

    # ------------------------------------------------------------------ autograd side
    def _on_output_backward(self, grad_outputs: Any) -> None:
        if self.state is ReducerState.FINALIZED:
            # A second backward through the same retained graph: reduce it as well, so
            # the gradients it adds are averaged too instead of silently local.
            self.state = ReducerState.ARMED
            self._reset_iteration()
        if self.state is ReducerState.ARMED:
            self._queue_finalize()

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_callback)

    def _on_grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        # The hot path: runs once per parameter per backward, so it stays flat.
        self._used_since_sync[index] = True
        state = self.state
        if state is not ReducerState.REDUCING:
            if state is not ReducerState.ARMED:
                return  # no_sync, or a backward not through a synced forward's outputs
            self._begin_reduction()
        if self.static_graph:
            self._on_static_grad(index)
            return
        ready = self._ready
        if ready[index]:
            self._errors.append(self._twice_error(index))
            return
        if self._rebuild.pending and self.iteration == 0:
            self._rebuild.order.append(index)
        ready[index] = True
        bucket = self.buckets.bucket_of[index]
        pending = self._pending
        pending[bucket] -= 1
        if pending[bucket] == 0:
            self.times.bucket_ready[bucket] = now()
            if bucket == self._next_bucket:
                self._launch_ready_buckets()

    def _on_static_grad(self, index: int) -> None:
        """static_graph: count hook firings; a parameter is ready at its expected count."""
        counts = self._static
        counts.fired[index] += 1
        fired = counts.fired[index]
        if counts.expected is None:
            if fired == 1 and self.iteration == 0:
                self._rebuild.order.append(index)
            return  # first static-graph iteration: everything is reduced at the end
        if fired == counts.expected[index]:
            self._mark_ready(index)
        elif fired > counts.expected[index]:
            self._errors.append(self._static_graph_error(index))

    def _begin_reduction(self) -> None:
        self.state = ReducerState.REDUCING
        self.phase = "backward"
        self.times.backward_start = now()
        self._queue_finalize()
        if not self._static.learning:
            unused = self._static.unused
        else:
            unused = self._forward_unused or set()
        self._known_unused = unused
        for index in sorted(unused):
            self._marked_unused.add(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        bucket = self.buckets.bucket_of[index]
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self.times.bucket_ready[bucket] = now()
            if bucket == self._next_bucket:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        pending = self._pending
        count = len(pending)
        while self._next_bucket < count and pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    # ------------------------------------------------------------------ reduction
    def _finalize_callback(self) -> None:
        self._callback_queued = False
        if self.state is not ReducerState.REDUCING:
            return  # this backward touched no parameter (e.g. autograd.grad on an input)
        try:
            with label("gradsync::finalize"):
                self._finalize()
        finally:
            self.state = ReducerState.FINALIZED

    def _finalize(self) -> None:
        self.times.finalize_start = now()
        self.phase = "the wait for gradient reductions at the end of backward"
        first_static_iteration = self.static_graph and self._static.learning
        # Whether to agree on the used map must be the same on every rank, so it depends
        # on the synced iteration count, which joined ranks advance too.
        agree_used = self.find_unused or (self.static_graph and self.iteration == 0)
        ready = self._ready
        missing = [i for i, r in enumerate(ready) if not r] if False in ready else []  # C-speed common case
        if missing and not first_static_iteration:
            if self._static.expected is not None:
                self._errors.extend(self._static_graph_error(i) for i in missing if self._static.expected[i])
            elif not self.find_unused:
                self._errors.append(
                    errors.unused_parameters([self.names[i] for i in missing], self.rank, self.iteration)
                )
        # Every bucket is launched, so every rank issues the same collectives even when
        # some parameters got no gradient here; their .grad (or zeros) is contributed.
        for index in missing:
            self._marked_unused.add(index)
            self._mark_ready(index)
        finish_hook_launches(self.comm_hook_state)
        globally_used = self._never_used  # static graph: parameters no rank used keep .grad None
        if agree_used:
            globally_used = self._agree_on_used()
        if self.keep_local:
            self._wait_and_defer(globally_used)
        else:
            after = None if self.fused_optimizer is None else self._step_fused
            self._errors.extend(
                self.buckets.write_back(
                    self._results, self.as_view, globally_used, self._marked_unused, self.hook_name, self.times, after
                )
            )
        # Every handle was waited for: let go of them now rather than at the next iteration, so
        # none outlives its process group at interpreter exit (a suspect, not proven, for a rare
        # "terminate called without an active exception" seen once at the exit of a 4-rank run).
        self._results = []
        if first_static_iteration:
            self._static.learn()
            if globally_used is not None:
                never = [self.names[i] for i, used in enumerate(globally_used) if not used]
                if never:
                    self._never_used = list(globally_used)
                    logger.info("static graph: parameters unused on every rank: %s", never)
        self._used_since_sync = [False] * len(self.params)
        self._record_iteration()
        self.iteration += 1
        if self._errors:
            self._raise_errors()

    @property
    def reducing(self) -> bool:
        """A synced backward is running: buckets are being launched."""
        return self.state is ReducerState.REDUCING

    def _step_fused(self, b: int) -> None:
        self.fused_optimizer.step_bucket(self.buckets, b)  # [Note: stepping as buckets complete]

    # ------------------------------------------------------------------ hooks
    @property
    def hook_name(self) -> str | None:
        return None if self.comm_hook is None else launch.hook_name(self.comm_hook)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self.comm_hook_state = state
        self.comm_hook = hook

    def remove_hooks(self) -> None:
        self._grad_hooks.remove()
        for handle in self._output_hook_handles:
            handle.remove()
        self._output_hook_handles = []

    def retire(self) -> None:
        """A newer reducer took over these parameters ([Note: discarded wrappers] in ownership.py)."""
        self.remove_hooks()
        self.retired = True
