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

Lifecycle per iteration: ``before_forward`` → ``arm`` (after a synced forward) →
``_mark_ready`` (per parameter, from autograd) → ``_launch`` (per bucket, strictly in index
order) → ``_finalize`` (once, at the end of backward). ``disarm`` after a forward that must not
sync. These are gradsync's names; torch's (``prepare_for_backward``, ``_rebuild_buckets``, ...)
are spoken by the facade ``ddp.reducer`` (compat/torch_reducer.py).

The state is in ``Reducer.__init__``: each part an object of its own, in a module of its own.

[Note: launch order]
A bucket whose parameters are all ready is launched only after every bucket before it
was launched. Gradients may become ready in a different order on each rank; launching
in index order makes every rank issue the same sequence of collectives anyway.

[Note: end-of-backward callback]
``_finalize`` runs as an autograd-engine callback queued on the *outermost* backward. A
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

from ..observability.cuda_clock import cuda_clock_for
from ..observability.desync import DesyncDetector, Position
from ..observability.labels import label
from ..observability.stats import DDPStats
from ..observability.timing import now
from . import errors, graph, ownership
from .autograd_context import BackwardKind, ContextGradients, DistributedBackwards
from .backward_pass import BackwardPass
from .bucket_layout import BucketLayout
from .bucket_set import BucketSet
from .config import ReducerConfig
from .divisor import Divisor
from .fused_optim import FusedOptimizer
from .records import Records, collect_stats
from .reductions import AllReduce, CommHook, CommHookReduction, LaunchContext, Reduction
from .static_graph import Firing, StaticGraphCounts
from .streams import stream_order_for
from .tolerance import Tolerance
from .usage import ParameterUsage

logger = logging.getLogger(__name__)


class ReducerState(enum.Enum):
    IDLE = "idle"  # no synced forward is waiting for its backward; hooks only note usage
    ARMED = "armed"  # a synced forward ran; its backward has not started yet
    REDUCING = "reducing"  # a synced backward is running: buckets are being launched
    FINALIZED = "finalized"  # averaged gradients of the last synced forward are in .grad


class Reducer:
    """Buckets, readiness tracking and reduction for one wrapped module."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        process_group: dist.ProcessGroup,
        config: ReducerConfig,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        count = len(self.params)
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # the buckets, their caps and the one-time rebuild, and how they change (bucket_layout.py)
        self.layout = BucketLayout(self.params, config)
        self.reduction: Reduction = AllReduce(process_group)  # how a bucket is averaged (reductions.py)
        self.fused_optimizer: FusedOptimizer | None = None  # steps each bucket as it completes (fused_optim.py)
        self.desync: DesyncDetector | None = None  # debug mode: agree on every collective first
        # which parameters a backward uses (usage.py)
        self.usage = ParameterUsage(count, config.find_unused_parameters, config.static_graph)
        self.static = StaticGraphCounts(count)  # static_graph's hook counts (static_graph.py)
        self.divisor = Divisor(self.world_size)  # what sums are divided by (divisor.py)
        # stats, trace timeline, last error (records.py); on CUDA read from events (observability/cuda_clock.py)
        self.records = Records(len(self.buckets.storages), cuda_clock_for(self.buckets.device))
        # CUDA only, else None: the streams each bucket waits for before launch ([Note: stream order] in streams.py)
        self.streams = stream_order_for(self.buckets.device)
        self.tolerance = Tolerance(config.keep_local_grads)  # the fault-tolerant mode's failures (tolerance.py)
        self.state = ReducerState.IDLE
        self.iteration = 0  # synced backwards finalized so far
        self.synced_forwards = 0  # every rank counts the same; desync checks compare it
        self.phase = "construction"  # named in errors when a collective fails
        self.retired = False  # replaced by a newer reducer of the same parameters
        self.current = BackwardPass(count, self.buckets)
        self._output_hooks: list[Any] = []  # pre-hooks on the armed forward's output nodes
        self._callback_queued = False
        # each backward's kind, and the context a dist backward writes into (autograd_context.py)
        self.distributed = DistributedBackwards(self, self.params)
        self._grad_hooks = ownership.GradHooks(self, self.params)
        for previous in ownership.claim(self, self.params):
            previous.retire()

    # ------------------------------------------------------------------ lifecycle
    def _begin_pass(self) -> None:
        self.current = BackwardPass(len(self.params), self.buckets)
        self.static.reset()
        self.divisor.reset()
        self.buckets.begin_iteration()
        if self.streams is not None:  # CUDA
            self.streams.begin_pass(self.buckets.bucket_of, len(self.buckets.storages))
            self.records.clock.begin_pass(len(self.buckets.storages))  # type: ignore[union-attr]  # CUDA: a clock

    def before_forward(self) -> None:
        """Before every grad-enabled forward: check the last backward finished; rebuild once."""
        if self.state is ReducerState.REDUCING:
            if self.buckets.context is not None:
                # A dist backward whose gradients did not all arrive: finish it now, so the other
                # ranks' collectives complete, and raise naming the parameters that got none.
                self._finalize_callback()
            raise RuntimeError(errors.backward_never_finished(self.rank, self.iteration))
        self.rebuild_once()
        if self.records.clock is not None:
            self.records.clock.forward_started()

    def arm(self, output: Any) -> None:
        """After a synced forward: the next backward through ``output`` reduces.

        Frameworks also arm a backward whose forward ran unsynced (torch's
        ``prepare_for_backward``, see compat/torch_reducer.py); with no tensors in ``output``
        nothing tells which parameters it uses, and with ``find_unused_parameters`` those that
        report nothing by its end count as unused.
        """
        for handle in self._output_hooks:
            handle.remove()
        roots = graph.output_grad_fns(output)
        self._output_hooks = [node.register_prehook(self._on_output_backward) for node in roots]
        self.distributed.arm()
        if self.config.find_unused_parameters and not self.config.static_graph:
            roots = self.distributed.search_roots(roots)
            self.usage.search(roots, self.params, combine=self.state is ReducerState.ARMED)
        self.state = ReducerState.ARMED
        self.synced_forwards += 1
        if self.records.clock is not None:
            self.records.clock.forward_ended()
        self._begin_pass()

    def disarm(self) -> None:
        """After a forward that must not sync (``no_sync``): its backward accumulates locally."""
        self.distributed.end_backward()
        if self.state is ReducerState.ARMED:
            self.state = ReducerState.IDLE

    @property
    def reducing(self) -> bool:
        """A synced backward is running: buckets are being launched."""
        return self.state is ReducerState.REDUCING

    def check_finalized(self) -> None:
        if self.reducing:
            raise RuntimeError(errors.backward_never_finished(self.rank, self.iteration))

    def finalize_now(self) -> None:
        """Inside a backward: finalize at once instead of at its end; after one: nothing left to do."""
        if self.reducing:
            self._finalize_callback()

    # ------------------------------------------------------------------ autograd side
    def _on_output_backward(self, grad_outputs: Any) -> None:
        if self.state is ReducerState.FINALIZED:
            # A second backward through the same retained graph: reduce it as well, so
            # the gradients it adds are averaged too instead of silently local.
            self.state = ReducerState.ARMED
            self._begin_pass()
        if self.state is ReducerState.ARMED:
            kind = self.distributed.kind_at_start()
            if kind is BackwardKind.AUTOGRAD_GRAD:
                raise RuntimeError(errors.autograd_grad_through_wrapper(self.rank, self.iteration))
            if kind is BackwardKind.ORDINARY:
                self._queue_finalize()
            # Otherwise a dist backward (its hooks queue the end of backward) or one that
            # accumulates into no parameter of ours: nothing to reduce.

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_callback)

    def _on_grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        # The hot path: runs once per parameter per backward, so it stays flat.
        self.usage.used_since_sync[index] = True
        state = self.state
        if state is not ReducerState.REDUCING:
            if state is not ReducerState.ARMED:
                return  # no_sync, or a backward not through a synced forward's outputs
            self._begin_reduction()
        if self.streams is not None:  # CUDA: which stream produced this gradient ([Note: stream order])
            self.streams.note(index)
        if self.config.static_graph:
            self._on_static_grad(index)
            return
        current = self.current
        ready = current.ready
        if ready[index]:
            current.errors.append(errors.gradient_in_pieces(self.names[index], self.rank, self.iteration))
            return
        if self.layout.rebuild.pending and self.iteration == 0:
            self.layout.rebuild.order.append(index)
        if current.mark_ready(index):
            self._launch_ready_buckets()

    def _on_static_grad(self, index: int) -> None:
        """static_graph: a parameter is ready once its hook fired as often as in the first backward
        (which is reduced as a whole at its end)."""
        firing = self.static.fire(index)
        if firing is Firing.READY:
            self._mark_ready(index)
        elif firing is Firing.FIRST_SEEN and self.iteration == 0:
            self.layout.rebuild.order.append(index)
        elif firing is Firing.TOO_MANY:
            self.current.errors.append(self._static_graph_error(index))

    def _on_context_grad(self, index: int, incoming: torch.Tensor | None) -> None:
        """An ``AccumulateGrad`` node's post hook (registered once RPC runs): under distributed
        autograd it reports what the post-accumulate-grad hook reports in an ordinary backward."""
        if self.distributed.kind_for(index) is BackwardKind.ORDINARY:
            return  # the post-accumulate-grad hook has reported it
        if self.state is ReducerState.ARMED:
            self._begin_context_reduction()
        if self.state is ReducerState.REDUCING:
            context = self.buckets.context
            if context is not None and context.context_id is None and incoming is not None:
                context.captured[id(self.params[index])] = incoming
            if self.distributed.first_in_task():  # one end-of-backward check per graph task
                Variable._execution_engine.queue_callback(self._on_context_callback)
        self._on_grad_accumulated(index, self.params[index])

    def _begin_context_reduction(self) -> None:
        """The first gradient of a dist backward: read from and write into the armed forward's context."""
        plain = isinstance(self.reduction, (AllReduce, CommHookReduction)) and self.fused_optimizer is None
        if self.tolerance.enabled or not plain:
            what = "The fault-tolerant mode" if self.tolerance.enabled else "A sharded or fused optimizer"
            raise RuntimeError(errors.unsupported_under_dist_autograd(what, self.rank))
        self.buckets.context = ContextGradients(self.distributed.armed_context)
        if self.distributed.armed_context is None:
            self.current.errors.append(errors.context_entered_after_forward(self.rank, self.iteration))
        self._begin_reduction(queue_finalize=False)

    def _on_context_callback(self) -> None:
        """The end of one graph task of a dist backward: finish once every bucket was launched. A
        gradient that comes back later through an RPC arrives in a later task; one that never
        comes is found at the next forward (``before_forward``)."""
        if self.state is not ReducerState.REDUCING:
            return
        all_launched = self.current.next_bucket == len(self.buckets.storages)
        if all_launched or (self.config.static_graph and self.static.learning):
            self._finalize_callback()

    def _begin_reduction(self, queue_finalize: bool = True) -> None:
        context_id = self.distributed.armed_context
        if queue_finalize and context_id is not None:  # an ordinary backward after a forward in a context
            self.current.errors.append(errors.ordinary_backward_in_context(context_id, self.rank, self.iteration))
        self.state = ReducerState.REDUCING
        self.phase = "backward"
        self.current.times.backward_start = now()
        if self.records.clock is not None:
            self.records.clock.backward_started()
        if queue_finalize:
            self._queue_finalize()
        unused = self.static.unused if not self.static.learning else (self.usage.forward_unused or set())
        self.current.known_unused = unused
        for index in sorted(unused):
            self.current.marked_unused.add(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self.current.mark_ready(index):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        for b in self.current.launchable():
            self._launch(b)

    def _launch(self, b: int) -> None:
        """Start bucket ``b``: its turn has come ([Note: launch order])."""
        with label("gradsync::reduce_bucket"):
            current = self.current
            current.times.bucket_launch[b] = now()
            storage = self.buckets.storages[b]
            if self.tolerance.failures:
                current.launched.append(None)  # fault-tolerant mode: this step failed, start nothing more
                return
            if self.desync is not None:
                what = f"all-reduce of bucket {b}"
                self.desync.check(Position(what, self.synced_forwards, storage.numel, str(storage.dtype)))
            known_unused = current.known_unused
            if (
                self.config.skip_all_reduce_unused_params
                and known_unused
                and known_unused.issuperset(storage.param_indices)
            ):
                current.launched.append(None)  # skip_all_reduce_unused_params: no collective, .grad untouched
                return
            if self.streams is not None:  # CUDA: [Note: stream order] in streams.py
                self.streams.wait_for_producers(b)
                self.records.clock.launched(b)  # type: ignore[union-attr]  # CUDA: a clock
            started = self.reduction.start(self._launch_context(), b)
            current.launched.append(started.pending)
            current.errors.extend(started.errors)
            if self.streams is not None:
                self.records.clock.watch(b, started.pending)  # type: ignore[union-attr]  # CUDA: a clock
            if self.records.timeline is not None and started.pending is not None:
                self.records.watch_completion(current.times, b, started.pending)

    def _launch_context(self) -> LaunchContext:
        return LaunchContext(
            self.buckets,
            self.divisor.take,
            self.current.marked_unused,
            self.names,
            self.config.gradient_as_bucket_view,
            self.rank,
            self.iteration,
        )

    # ------------------------------------------------------------------ end of backward
    def _finalize_callback(self) -> None:
        self._callback_queued = False
        if self.state is not ReducerState.REDUCING:
            return  # this backward touched no parameter (e.g. autograd.grad on an input)
        try:
            with label("gradsync::finalize"):
                self._finalize()
        finally:
            self.state = ReducerState.FINALIZED
            self.buckets.context = None  # later backwards read .grad unless they too are dist ones
            self.distributed.end_backward()

    def _finalize(self) -> None:
        current, config = self.current, self.config
        current.times.finalize_start = now()
        if self.records.clock is not None:
            self.records.clock.finalize_started()
        self.phase = "the wait for gradient reductions at the end of backward"
        first_static_iteration = config.static_graph and self.static.learning
        self._launch_the_rest(report=not first_static_iteration)
        self.reduction.end_of_pass()
        globally_used = self.usage.never_used  # static graph: parameters no rank used keep .grad None
        if self.usage.must_agree(self.iteration):
            globally_used = self._agree_on_used()
        self._write_averages(globally_used)
        # Every handle was waited for: let go of them now rather than at the next iteration, so
        # none outlives its process group at interpreter exit (a suspect, not proven, for a rare
        # "terminate called without an active exception" seen once at the exit of a 4-rank run).
        current.launched = []
        if first_static_iteration:
            self._learn_static_graph(globally_used)
        self.usage.end_synced_backward()
        warn = config.find_unused_parameters and not config.static_graph
        self.records.record(self.iteration, current, self.buckets, self.names, self.rank, warn)
        self.iteration += 1
        self._check_context()
        if current.errors:
            self._raise_errors(current.errors)

    def _launch_the_rest(self, report: bool) -> None:
        """Parameters that got no gradient in this backward are ready now: every bucket is launched, so
        every rank issues the same collectives; their ``.grad`` (or zeros) is contributed. ``report``:
        name them unless ``find_unused_parameters`` allows it."""
        current = self.current
        ready = current.ready
        missing = [i for i, r in enumerate(ready) if not r] if False in ready else []  # C-speed common case
        if missing and report:
            if self.static.expected is not None:
                current.errors.extend(self._static_graph_error(i) for i in missing if self.static.expected[i])
            elif not self.config.find_unused_parameters:
                names = [self.names[i] for i in missing]
                current.errors.append(errors.unused_parameters(names, self.rank, self.iteration))
        for index in missing:
            current.marked_unused.add(index)
            self._mark_ready(index)

    def _write_averages(self, globally_used: list[bool] | None) -> None:
        """Wait for every bucket and write the averages (the fault-tolerant mode: keep them until decided)."""
        current = self.current
        if self.tolerance.enabled:
            self.reduction.finish_tolerant(self.buckets, current, self.tolerance, globally_used)
            return
        after = None if self.fused_optimizer is None else self._step_fused
        as_view = self.config.gradient_as_bucket_view
        problems = self.reduction.finish(
            self.buckets, current.launched, as_view, globally_used, current.marked_unused, current.times, after
        )
        current.errors.extend(problems)

    def _check_context(self) -> None:
        """A dist backward: name what could not be written into its context."""
        context = self.buckets.context
        if context is None:
            return
        if context.missing_context:
            self.current.errors.append(errors.context_released(context.context_id, self.rank, self.iteration - 1))
        elif context.unplaced:
            names = [self.names[i] for i in sorted(context.unplaced)]
            self.current.errors.append(errors.average_without_place(names, self.rank, self.iteration - 1))

    def _agree_on_used(self) -> list[bool] | None:
        """Which parameters any rank used; None (local use) once a fault-tolerant step failed."""
        if self.tolerance.failures:
            return None
        try:
            return self.usage.agree(self.process_group, self.buckets.device, self.desync, self.synced_forwards)
        except RuntimeError as error:
            if not self.tolerance.note(f"the used-parameter all-reduce failed: {error}"):
                raise
            return None

    def _learn_static_graph(self, globally_used: list[bool] | None) -> None:
        self.static.learn()
        never = self.usage.learn_never_used(globally_used)
        if never:
            logger.info("static graph: parameters unused on every rank: %s", [self.names[i] for i in never])

    def _step_fused(self, b: int) -> None:
        # Passed as ``after`` only while there is a fused optimizer (_write_averages).
        self.fused_optimizer.step_bucket(self.buckets, b)  # type: ignore[union-attr]  # [Note: stepping as buckets complete]

    # ------------------------------------------------------------------ errors
    def _raise_errors(self, problems: list[str | Exception]) -> None:
        def describe(message: str) -> str:
            return self.collective_failure_message(message, iteration=self.iteration - 1)

        error = errors.backward_error(problems, describe)
        self.records.last_error = str(error)
        raise error

    def collective_failure_message(self, detail: str, iteration: int | None = None) -> str:
        """Where this rank was when a collective failed, and which ranks are gone."""
        iteration = self.iteration if iteration is None else iteration
        return errors.collective_failed(self.rank, f"{self.phase} of iteration {iteration}", detail)

    def _static_graph_error(self, index: int) -> str:
        return self.static.changed_error(self.names[index], index, self.rank, self.iteration)

    # ------------------------------------------------------------------ buckets
    @property
    def buckets(self) -> BucketSet:
        return self.layout.buckets

    @property
    def rebuilt(self) -> bool:
        return self.layout.rebuild.done

    def rebuild_once(self) -> bool:
        """Rebuild the buckets once, after the first synced backward; True if this call did.

        [Note: bucket rebuild] in rebuild.py. Every call after the rebuild is a no-op.
        """
        rebuild = self.layout.rebuild
        if not rebuild.due(self.iteration, self.reducing):
            return False
        self.phase = "the one-time bucket rebuild broadcast"
        try:
            order = rebuild.agreed_order(self.process_group, self.buckets.device, self.desync, self.synced_forwards)
        except RuntimeError as error:
            # fault-tolerant mode: the step is decided, and the buckets shipped, later
            if self.tolerance.note(f"the bucket order broadcast failed: {error}"):
                return False
            raise RuntimeError(self.collective_failure_message(str(error))) from error
        self.current.launched = []  # the last iteration's work handles still reference the old buffers
        self.layout.rebuild_in(order, self.reduction)
        self._new_layout()
        logger.info("rank %d: rebuilt %d buckets in gradient-ready order", self.rank, len(self.buckets.storages))
        return True

    def adopt_layout(self, order: list[int], caps: list[int], rebuilt: bool) -> None:
        """Build the buckets another rank has ([Note: a joiner's buckets] in elastic/heal.py)."""
        self.layout.adopt(order, caps, rebuilt, self.reduction)
        self._new_layout()

    def _new_layout(self) -> None:
        """The records and the pass in progress follow new buckets."""
        self.records.running.new_layout(len(self.buckets.storages))
        self._begin_pass()

    # ------------------------------------------------------------------ other passes
    def reduce_again(self) -> None:
        """Reduce the local gradients again, over this reducer's (new) group; results deferred.

        The fault-tolerant survivors' redo of a step that did not commit: every bucket is started
        as backward would, from ``.grad`` (kept local by ``keep_local_grads``); a parameter
        without a gradient contributes zeros.
        """
        self._begin_pass()
        self.tolerance.failures = []
        context = self._launch_context()
        for b in range(len(self.buckets.storages)):
            started = self.reduction.start(context, b)
            self.current.launched.append(started.pending)
            self.current.errors.extend(started.errors)
        self.reduction.end_of_pass()
        self.tolerance.wait_and_defer(self.buckets, self.current, self.reduction.name, None)
        self.current.launched = []

    def write_deferred(self) -> None:
        """The fault-tolerant mode: write the committed step's averages to ``.grad``."""
        self.tolerance.write_deferred(self.buckets, self.config.gradient_as_bucket_view, self.reduction.name)

    def shadow_backward(self) -> None:
        """A joined rank's part of one synced backward: every bucket, in order, with zeros."""
        pending = [self.reduction.start_zeros(self.buckets, b) for b in range(len(self.buckets.storages))]
        self.reduction.end_of_pass()
        globally_used = self.usage.shadow_agree(self.iteration, self.process_group, self.buckets.device)
        self.reduction.finish_shadow(self.buckets, pending, globally_used)
        self.iteration += 1

    # ------------------------------------------------------------------ hooks and reports
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        self.reduction = CommHookReduction(hook, state)

    def use_reduction(self, reduction: Reduction, pad_multiple: int = 1) -> None:
        """Reduce with ``reduction`` from now on (a sharded optimizer's reduce-scatter), before training.

        The buckets are built again with flat buffers padded to ``pad_multiple`` and no lone
        gradient reduced in place (its ``.grad`` would not be where the reduction reads).
        """
        if self.iteration > 0 or self.state is not ReducerState.IDLE:
            raise RuntimeError(
                f"the reduction can only be replaced before the first synced forward (rank {self.rank}, "
                f"iteration {self.iteration}); build the sharded optimizer right after the wrapper."
            )
        self.reduction = reduction
        self.layout.pad_for(reduction, pad_multiple)
        self._new_layout()

    def stats(self) -> DDPStats:
        rebuilt, hook = self.rebuilt, self.reduction.name
        return collect_stats(
            self.records, self.buckets, self.names, self.config, self.rank, self.world_size, rebuilt, hook
        )

    def remove_hooks(self) -> None:
        self._grad_hooks.remove()
        self.distributed.remove_hooks()
        for handle in self._output_hooks:
            handle.remove()
        self._output_hooks = []

    def retire(self) -> None:
        """A newer reducer took over these parameters ([Note: discarded wrappers] in ownership.py)."""
        self.remove_hooks()
        self.retired = True
