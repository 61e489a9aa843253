"""``DiLoCo``: H local steps, then an outer step on the replicas' averaged outer gradient.

[Note: DiLoCo in one paragraph]
Every replica starts from the same ``theta_global`` (broadcast when ``DiLoCo`` is built) and takes
inner steps with its own optimizer on its own data. After ``H = sync_every`` of them each replica's
outer gradient ``delta_i = theta_global - theta_local_i`` (old global minus new local: the sign
torchft once got wrong) is averaged across replicas, and the outer optimizer steps ``theta_global``
with that average as its gradient; the new ``theta_global`` becomes every replica's parameters.
The inner optimizer's state stays per replica (the paper found syncing it gains nothing). With
``fragments = F`` the layers are split into ``F`` fragments synced at staggered steps
(fragments.py); with ``delay = tau`` a fragment's exchange runs on a thread while ``tau`` more
inner steps are taken, and the local parameters are then merged: by default as the paper does,
``theta_local <- alpha * theta_local + (1 - alpha) * theta_global``, or with
``merge="keep_inner_steps"`` as the new ``theta_global`` plus the ``tau`` inner steps
([Note: the merge that keeps the inner steps]); with ``delay = 0`` they are replaced. ``LocalSGD``
is the special case of outer SGD with lr 1 and no momentum (local_sgd.py).

Between outer steps ``DiLoCo.step()`` is the inner optimizer's step and one integer comparison:
fragments, flat copies and collectives are touched only at the steps the schedule names.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.broadcast import broadcast_coalesced
from ..wrapper.data_parallel import DataParallelWrapper
from . import checks, finite, topology
from .buffers import BufferAverage
from .error_feedback import ErrorFeedback, slice_length
from .exchange import Averaged, OuterExchange, WireCount
from .fragments import Schedule
from .host_state import ready
from .in_flight import InFlight, from_state, held, to_state
from .outer_params import Fragment, fragment_layers
from .placement import OnHost, placement_for
from .uneven import UnevenInputs
from .wire import wire_format

logger = logging.getLogger(__name__)

OuterOptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# The paper's outer optimizer (arXiv 2311.08105, Table 5): Nesterov, lr 0.7, momentum 0.9.
nesterov = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


class DiLoCo:
    """Wraps ``inner_optimizer``: call ``outer.step()`` where the loop called ``inner_optimizer.step()``.

    ``model`` is a plain module (every process a replica, exchanging over ``group``, default all) or
    a gradsync ``DistributedDataParallel`` over one island's process group ([Note: islands] in
    topology.py; ``group`` must then be None). Building it is collective over the default group.
    ``fragments``: a count (layers strided over them), or one entry per fragment, each a submodule, a
    parameter or a list of those, together holding every parameter once ([Note: fragments the user
    names] in outer_params.py).
    ``exchange`` is whatever averages outer gradients (``start``/``finished``/``close``/``count``):
    gradsync.elastic_diloco replaces it with one decided together and redone among survivors.
    ``buffers``: ``"average"`` makes the model's buffers (BatchNorm's statistics) agree across replicas
    once a round, ``"local"`` leaves each replica its own ([Note: buffers at outer steps] in buffers.py).
    ``outer_state``: with parameters on a GPU, where ``theta_global`` and the outer optimizer's state live:
    ``"host"`` (pinned host memory, one fragment at a time on the GPU) or ``"device"`` (the GPU, 8 more bytes
    per parameter there); on CPU both are the same ([Note: the outer state off the GPU] in host_state.py).
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int | Sequence[object] = 1,
        delay: int = 0,
        alpha: float = 0.5,
        wire: str = "fp32",
        group: dist.ProcessGroup | None = None,
        *,
        merge: str = "mix",
        error_feedback: bool = False,
        buffers: str = "average",
        islands_wired_by_caller: bool = False,
        outer_state: str = "host",
    ) -> None:
        checks.check_model(model)
        # gradsync.elastic_diloco passes the island DDP's module and rewires the island every generation itself
        checks.check_inner_optimizer(model, inner_optimizer, island_known=islands_wired_by_caller)
        checks.check_knobs(alpha, merge, outer_optimizer)
        checks.check_error_feedback(error_feedback, wire)
        self.schedule = Schedule.checked(sync_every, checks.fragment_count(fragments), delay)
        self.wire_format = wire_format(wire)
        self.island = model if isinstance(model, DataParallelWrapper) else None
        self.module: nn.Module = self.island.module if self.island is not None else model
        self.inner = inner_optimizer
        self.alpha = float(alpha)
        self.merge = merge
        self.buffers = BufferAverage(self.module, buffers)  # checks the mode before any collective
        self._buffers_by_exchange = False  # True once an exchange that averages them replaced ours
        # None on CPU; on a GPU the exchange runs on host tensors, over gloo groups of its own
        self.placement = placement_for(next(self.module.parameters()).device, outer_state)
        on_gpu = self.placement is not None
        island_group = self.island.process_group if self.island is not None else None
        self.topology = topology.for_model(island_group, group, delay > 0 or on_gpu, "gloo" if on_gpu else None)
        t = self.topology
        self._wait_for_params()  # an inner optimizer stepped before DiLoCo was built may still be gathering
        # Every replica starts from the same point: outer rank 0's parameters and buffers.
        start = list(self.module.parameters()) + list(self.module.buffers())
        with torch.no_grad():
            if t.sends_across:
                across, source = t.across()
                broadcast_coalesced(start, source, across)
            if not t.equal_islands:  # members without counterparts take them from their island's first member
                island, first = t.within()
                broadcast_coalesced(start, first, island)
        home = torch.device("cpu") if self.placement is not None and self.placement.on_host else None
        pin = self.placement is not None and self.placement.kit.pin
        self.fragments = [Fragment(p, ls, home, pin) for p, ls in enumerate(fragment_layers(self.module, fragments))]
        if self.placement is not None:
            self.placement.prepare(self.fragments)
        self.feedback = (  # [Note: error feedback] in error_feedback.py
            ErrorFeedback([_slice_of(f.numel, t) for f in self.fragments]) if error_feedback else None
        )
        self.outer_optimizer = (outer_optimizer or nesterov)([f.theta for f in self.fragments])
        checks.check_outer_optimizer(self.outer_optimizer)
        agreed = {**self._description(), "alpha": self.alpha, "merge": merge, "buffers": buffers, "state": outer_state}
        agreed["outer"] = type(self.outer_optimizer).__name__
        agreed["sizes"] = [(f.numel, str(f.theta.dtype)) for f in self.fragments]
        groups = [g for g in (t.outer, t.island) if g is not None]
        checks.check_replicas_agree(agreed, groups)
        self.exchange = OuterExchange(self.topology, self.wire_format, overlap=delay > 0)
        self.step_count = 0  # inner steps taken: the schedule's clock, the same on every replica
        self._next_event = self.schedule.next_event(0)
        self._in_flight: InFlight | None = None
        self._uneven: UnevenInputs | None = None  # inside outer.join()

    # -- the training loop's calls ---------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The inner optimizer's step; an outer step (or a fragment's start or landing) when one is due."""
        loss = self.inner.step() if closure is None else self.inner.step(closure)
        self.step_count += 1
        if self.step_count == self._next_event:
            self._at_event(self.step_count)
            self._next_event = self.schedule.next_event(self.step_count)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @contextmanager
    def join(self) -> Iterator[None]:
        """For replicas with different numbers of batches: enter on every replica at the same step, train
        inside; a replica whose loop ends goes on taking part in the outer exchanges (without inner steps)
        until every replica's loop has ended and its last inner steps are sent. Averages are over the
        replicas that contributed ([Note: joining at outer steps] in uneven.py). Nothing is sent between
        outer steps; each exchange inside carries 8 more bytes."""
        if self._uneven is not None:
            raise RuntimeError(f"outer.join() is already active on rank {dist.get_rank()}; do not nest it.")
        self._uneven = UnevenInputs(self.schedule.sync_every, self.schedule.fragments)
        try:
            yield
            self._uneven.last_step = self.step_count
            while not self._uneven.everyone_done:  # the schedule's clock runs on without inner steps
                self.step_count = self._next_event
                self._at_event(self.step_count)
                self._next_event = self.schedule.next_event(self.step_count)
        finally:
            self._uneven = None

    def replace_exchange(self, exchange: Any, averages_buffers: bool = False) -> None:
        """Average outer gradients through ``exchange`` from now on (``start``/``finished``/``close``/``count``,
        as ``OuterExchange``); DiLoCo's own exchange, its thread and the process groups made for it are closed.
        ``averages_buffers``: the exchange also averages the buffers at the round's last landing (DiLoCo's own
        collective for them is then skipped).

        gradsync.elastic_diloco.FaultTolerantDiLoCo calls it once, before the first step, with an exchange
        decided together and redone among survivors over each generation's group.
        """
        if self.step_count or self._in_flight is not None:
            raise RuntimeError(
                f"DiLoCo.replace_exchange() after {self.step_count} inner steps (rank {dist.get_rank()}): replace the "
                "exchange before the first step, when no exchange can be in flight."
            )
        self.exchange.close()
        topology.close(self.topology)
        self.exchange = exchange
        self._buffers_by_exchange = averages_buffers

    @property
    def wire(self) -> WireCount:
        """Bytes this process sent for the outer exchange (over the slow link and inside its island)."""
        return self.exchange.count

    @property
    def global_parameters(self) -> list[nn.Parameter]:
        """``theta_global``, one flat tensor per fragment (the outer optimizer's parameters)."""
        return [f.theta for f in self.fragments]

    # -- outer steps -----------------------------------------------------------------------------

    def _at_event(self, step: int) -> None:
        self._wait_for_params()
        starting = self.schedule.starting_after(step)
        if starting is not None:
            assert self._in_flight is None, "a fragment started while another was in flight (the schedule forbids it)"
            with torch.profiler.record_function("gradsync::diloco_start_exchange"):
                delta = self._outer_gradient(self.fragments[starting])
                flags = None if self._uneven is None else self._uneven.flags(step)
                residuals = None if self.feedback is None else self.feedback.of(starting)
                self._in_flight = InFlight(starting, step, self.exchange.start(delta, flags, residuals), delta)
        landing = self.schedule.landing_after(step)
        if landing is not None:
            with torch.profiler.record_function("gradsync::diloco_outer_step"):
                sent = self._in_flight.sent if self._in_flight is not None else None
                averaged = self._wait()
                sent = None if sent is None else ready(sent)  # on the host by now: the exchange waited for it
                if averaged.values is not None:
                    finite.check_average(averaged.values, sent, self.fragments[landing], self.topology)
                    self._outer_step(landing, averaged.values, sent)
                if self.feedback is not None and averaged.residuals is not None:
                    self.feedback.commit(landing, averaged.residuals)
                if self._uneven is not None:
                    self._uneven.landed(averaged.active)
                if self.round_ends_at(landing) and self.buffers.to_average and not self._buffers_by_exchange:
                    self._average_buffers()

    def _outer_gradient(self, fragment: Fragment) -> Any:
        """``theta_global - theta_local`` of ``fragment``: a tensor, or on a GPU one on its way to the host that
        DiLoCo's own exchange waits for on its thread; any other exchange gets it here, on the host."""
        if self.placement is None:
            return fragment.outer_gradient()
        delta = self.placement.outer_gradient(fragment)
        return delta if isinstance(self.exchange, OuterExchange) else ready(delta)

    def _wait_for_params(self) -> None:
        """An inner optimizer that gathers parameters after its step (gradsync.zero's ShardedOptimizer inside
        an island) finishes that first: an outer step reads and writes whole parameters, and a gather landing
        after the write would put the pre-outer-step values back. Only at outer-step events."""
        wait = getattr(self.inner, "wait_for_params", None)
        if wait is not None:
            wait()

    def _average_buffers(self) -> None:
        """Once a round, with nothing in flight. Over islands each member averages with its counterparts; a
        larger island's members without any keep theirs, which their island's DDP replaces with its first
        member's (averaged) at the next forward, as it does for every member."""
        if self.topology.sends_across:
            self.buffers.average(*self.topology.across())

    def round_ends_at(self, landing: int | None) -> bool:
        """Whether fragment ``landing``'s outer step is the round's last (when buffers are averaged)."""
        return landing == self.schedule.fragments - 1

    def _wait(self) -> Averaged:
        in_flight = self._in_flight
        assert in_flight is not None, "a fragment landed that never started"
        try:
            return in_flight.average.result()
        except Exception as error:
            if not isinstance(in_flight.average, Future):  # FaultTolerantDiLoCo's decided exchange: its errors
                raise  # say what happened themselves (a lost store, a heal that did not match)
            raise RuntimeError(
                f"DiLoCo's outer exchange of fragment {in_flight.fragment} (started after inner step "
                f"{in_flight.started}) failed on rank {dist.get_rank()}: {error}. Every replica must call step() "
                "the same number of times. A dead replica ends a DiLoCo run; "
                "gradsync.elastic_diloco.FaultTolerantDiLoCo goes on without it (docs/diloco.md, Fault tolerance)."
            ) from error
        finally:
            self.exchange.finished()
            self._in_flight = None

    @torch.no_grad()
    def _outer_step(self, index: int, average: torch.Tensor, sent: torch.Tensor | None) -> None:
        fragment = self.fragments[index]
        before = fragment.theta.detach().clone() if self.merge == "keep_inner_steps" else None
        placed = self.placement
        fragment.theta.grad = average.to(fragment.theta.dtype) if placed is None else placed.gradient(fragment, average)
        try:
            self.outer_optimizer.step()  # only this fragment has a .grad: the others are skipped
        finally:
            fragment.theta.grad = None
        if isinstance(placed, OnHost):
            at_start = None if before is None or sent is None else before - sent
            placed.land(fragment, self.schedule.delay, self.merge, self.alpha, at_start)
        elif self.schedule.delay == 0:
            fragment.write(fragment.theta.detach())
        elif before is not None:
            assert sent is not None, "merge='keep_inner_steps' lost the outer gradient it sent"
            fragment.keep_inner_steps(sent, before)
        else:
            fragment.mix(self.alpha)
        logger.debug("outer step of fragment %d after inner step %d", index, self.step_count)

    # -- checkpoints -----------------------------------------------------------------------------

    def _description(self) -> dict[str, Any]:
        return {
            "sync_every": self.schedule.sync_every,
            "fragments": self.schedule.fragments,
            "delay": self.schedule.delay,
            "wire": self.wire_format.name,
            "fragment_parameters": [f.names for f in self.fragments],
            "error_feedback": self.feedback is not None,
        }

    def state_dict(self) -> dict[str, Any]:
        """theta_global, the outer optimizer, the step and the fragment schedule; an exchange in flight
        is waited for and its average kept, to be applied at the step it would have landed.

        The model and the inner optimizer are checkpointed by the caller, as without DiLoCo.
        """
        in_flight = None
        if self._in_flight is not None:  # [Note: a checkpoint with an exchange in flight] in in_flight.py
            pending = self._in_flight
            averaged = self._wait()
            self._in_flight = held(pending, averaged)
            self.exchange.count.in_flight += 1  # _wait counted it finished; it lands later
            in_flight = to_state(pending, averaged)
        return {
            "step": self.step_count,
            "global_parameters": [f.theta.detach().clone() for f in self.fragments],
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
            "schedule": self._description(),
            "in_flight": in_flight,
            "error_feedback": None if self.feedback is None else self.feedback.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ours = self._description()
        saved_schedule = {"error_feedback": False, **state["schedule"]}  # older checkpoints had no error feedback
        differ = sorted(k for k in ours if saved_schedule.get(k) != ours[k])
        if differ:
            raise ValueError(
                f"This DiLoCo checkpoint was saved with other {differ} (rank {dist.get_rank()}): saved "
                f"{ {k: saved_schedule.get(k) for k in differ} }, here { {k: ours[k] for k in differ} }. Build "
                "DiLoCo with the saved settings (and the same model) to resume."
            )
        if self._in_flight is not None:
            self._wait()  # collective: every replica has it in flight too; its result is replaced below
        with torch.no_grad():
            for fragment, theta in zip(self.fragments, state["global_parameters"]):
                fragment.theta.copy_(theta)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.step_count = int(state["step"])
        self._next_event = self.schedule.next_event(self.step_count)
        if self.feedback is not None:
            self.feedback.load_state_dict(state["error_feedback"], dist.get_rank())
        if state["in_flight"] is not None:
            self._in_flight = from_state(state["in_flight"], self.merge)
            self.exchange.count.in_flight += 1

    def close(self) -> None:
        """Wait for an exchange in flight, stop the exchange's thread, free the process groups made for it."""
        if self._in_flight is not None:
            self._wait()
        self.exchange.close()
        topology.close(self.topology)


def _slice_of(numel: int, t: topology.Topology) -> int:
    """How many of a fragment's ``numel`` values this process sends across (its island slice; none past them)."""
    return slice_length(numel, t.slices, t.island_rank) if t.sends_across else 0
