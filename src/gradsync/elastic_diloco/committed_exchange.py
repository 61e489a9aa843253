"""The outer exchange of a fault-tolerant DiLoCo: decided together, redone among the survivors.

[Note: an exchange cut off by a death]
The replicas' outer gradients are averaged by DiLoCo's own exchange (gradsync/diloco/exchange.py)
over the current generation's group, every collective waited for in slices that watch the
peers' heartbeats and the generation's ``trouble`` key (elastic/step_decision.py). Whether the
outer step commits is then decided exactly as a step of ``elastic.FaultTolerant`` is: a vote, one
all-reduce of two integers, or, where an exchange's collective or the vote failed, settled through
the store (elastic/settle.py). Survivors can disagree on whether the exchange completed (one got
every piece before the death, another did not): the decision, not the local outcome, counts.

A commit hands the average to DiLoCo, which applies the outer step. An abort (a replica died or
hung, during its inner steps or in the exchange) forms the next generation from the live members
and averages *the same outer gradients* again over its group: each survivor's ``delta_i`` was
computed once, from ``theta_global`` and its parameters, neither of which the cut-off exchange
touched. The average divides by the group's size, the replicas that contributed, so no survivor
loses an inner step; the dead replica's round is missing from the average as if it never ran.

[Note: a death while an exchange is in flight]
With ``delay = tau > 0`` (Streaming DiLoCo) a fragment's exchange runs on a thread of this
process while the training loop takes ``tau`` more inner steps; its collectives are waited for
as above, so a death makes the thread's try fail within a heartbeat timeout, and the loop does
not notice until the landing. There, and only there, the outer step is decided: the vote, the
settling and any redo are the training loop's, on the group nobody else is using by then (the
thread's try is over, one way or the other). A death anywhere between the start and the vote,
in the inner steps, in the exchange or after it completed, aborts the outer step (nobody's vote
completed), and the survivors average the same ``delta_i`` again over the next generation,
blocking this once, then merge at the landing step as if nothing had happened: the ``tau``
inner steps they took meanwhile are kept, the merge is DiLoCo's. Nothing is in flight at a
landing (``delay < sync_every / fragments``), so a joiner admitted there is healed from a
source whose DiLoCo state has no exchange in flight either.

[Note: buffers in a decided exchange]
DiLoCo averages the model's buffers once a round, after the round's last fragment landed
([Note: buffers at outer steps] in diloco/buffers.py). Here that collective is part of the
decision of that fragment's outer step: at the landing, in the training thread (the exchange's
try is over, so the group is free, and the buffers are the ones the inner steps left), each
member takes a copy of its buffers, they are all-gathered over the generation's group and summed
in rank order (a replay gets the same bits), counters taken from the group's rank 0, then the
vote. A failure there fails the vote like a failed exchange; a commit writes the average into
the buffers; an abort averages the same copies again over the survivors, with the outer
gradients. A joiner is healed with its source's buffers (they are in the model's state_dict).
Over unequal islands a member of a larger island without counterparts takes no part in it and
keeps its own buffers, as with DiLoCo: its island's DDP replaces them with its first member's
(averaged) at the next forward.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

from ..diloco.buffers import BufferAverage, BufferValues
from ..diloco.error_feedback import Residuals
from ..diloco.exchange import Averaged, OuterExchange, WireCount
from ..diloco.topology import Topology
from ..diloco.wire import WireFormat
from ..elastic import commit, membership, settle
from ..elastic.step_decision import StepDecider
from .contributions import ContributionScreen, Verdict

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome:
    """How the last exchange ended for this process; acted on once DiLoCo has applied the outer step."""

    decision: commit.Decision | None = None  # committed (with the joiners it admits), or None
    by_vote: bool = True  # False: settled in the store; the generation's group is broken
    revoked: settle.Revoked | None = None  # this process's last commit was overruled: it joins again
    left_out: bool = False  # the survivors formed a generation without this process: it joins again
    verdict: Verdict | None = None  # who the committed average left out ([Note: bad contributions are left out])


class Screening(NamedTuple):
    """What the exchange needs to leave bad contributions out ([Note: bad contributions are left out])."""

    screen: ContributionScreen
    describe: Callable[[torch.Tensor], tuple[torch.Tensor, list[str]]]  # health of an outer gradient, its names
    islands: Callable[[], tuple[list[list[int]], list[str]]]  # the generation's islands: global ranks, names


Described = tuple[torch.Tensor, list[str], list[list[int]], list[str]]  # health, parameter names, islands, names
Attempt = tuple[Averaged | None, list[str], Verdict | None]


class CommittedExchange:
    """What ``DiLoCo`` calls to average an outer gradient (start / finished / close / count)."""

    def __init__(
        self,
        decider: StepDecider,
        wire: WireFormat,
        outer_step: Callable[[], int],
        arrivals_known: Callable[[], int],
        reconfigure: Callable[[str], bool],
        overlap: bool = False,
        buffers: BufferAverage | None = None,
        round_ends: Callable[[], bool] | None = None,
        screening: Screening | None = None,
    ) -> None:
        self.decider = decider
        self.screening = screening
        self.wire = wire
        self.count = WireCount()
        self._outer_step = outer_step  # committed outer steps so far: the one deciding is the next
        self._arrivals_known = arrivals_known
        self._reconfigure = reconfigure  # forms the next generation of the live members; False: left out
        self._current: OuterExchange | None = None
        # Work handles of failed collectives and votes, kept for the life of the process: freeing
        # one whose gloo pair saw its peer die can end the process (elastic/commit.py).
        self.abandoned: list[dist.Work] = []
        membership.bury(self.abandoned)
        self.outcome: Outcome | None = None
        # With overlap (delay > 0) each exchange's first try runs on a thread of its own while the inner
        # steps go on; the decision, and any redo, are the training loop's, at landing.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gradsync-diloco-ft") if overlap else None
        self._attempt: Future[Attempt] | None = None
        self.redone = 0  # exchanges averaged again after an abort, over the life of the run
        # [Note: buffers in a decided exchange]: averaged with the exchange whose start round_ends() says ends a round
        self._buffers = buffers if buffers is not None and buffers.to_average else None
        self._round_ends = round_ends or (lambda: False)

    def rebind(self, topology: Topology) -> None:
        """Exchange over ``topology`` (the current generation's group) from now on."""
        self._current = OuterExchange(topology, self.wire, overlap=False, count=self.count, waiter=self.decider.wait)

    def start(
        self, delta: torch.Tensor, flags: tuple[float, float] | None = None, residuals: Residuals | None = None
    ) -> DecidedAverage:
        """Begin averaging ``delta`` over the current generation (on the thread with ``overlap``); the
        outer step is decided, and redone if it must be, when DiLoCo asks for the result at landing."""
        if flags is not None:
            raise RuntimeError(
                "outer.join() (uneven inputs) is not supported by FaultTolerantDiLoCo: a replica whose data ends "
                "can call close() instead; the others go on without it (it is not taken for dead: it left)."
            )
        assert self._current is not None, "rebind() before the first exchange"
        self.count.in_flight += 1
        self.count.peak_in_flight = max(self.count.peak_in_flight, self.count.in_flight)
        exchange = self._current  # the generation's, as the exchange starts (rebound only at landings)
        described = None
        if self.screening is not None:  # in the training thread: it reads the inner optimizer's state
            described = (*self.screening.describe(delta), *self.screening.islands())
        if self._thread is not None:
            self._attempt = self._thread.submit(self._average_once, exchange, delta, residuals, described)
        else:
            self._attempt = _done(self._average_once(exchange, delta, residuals, described))
        with_buffers = self._buffers is not None and self._round_ends()
        return DecidedAverage(lambda: self._decided(delta, residuals, with_buffers, described))

    def finished(self) -> None:
        self.count.in_flight -= 1

    def quiet(self) -> None:
        """Wait until the collectives of an exchange in flight are over (it is decided only at landing):
        the training thread may then use the group itself."""
        if self._attempt is not None:
            self._attempt.result()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def take_outcome(self) -> Outcome | None:
        outcome, self.outcome = self.outcome, None
        return outcome

    def _average_once(
        self, exchange: OuterExchange, delta: torch.Tensor, residuals: Residuals | None, described: Described | None
    ) -> Attempt:
        """One try over one generation's group: the average and who it left out, or None and why not."""
        try:
            verdict = agreed = None
            if described is not None and self.screening is not None:
                mine, names, islands, island_names = described
                verdict = self.screening.screen.verdict(mine, islands, names, exchange.collective)
                agreed = (verdict.contributors, not verdict.mine)
            # a redo starts from the same residuals: they are committed only with the applied average
            return exchange.average(delta, None, residuals, agreed), [], verdict
        except RuntimeError as error:
            self.abandoned.extend(exchange.works)
            return None, [f"the outer exchange failed: {error}"], None
        finally:
            exchange.works.clear()

    def _average_buffers(self, mine: BufferValues) -> tuple[BufferValues | None, list[str]]:
        """The buffers' average over the current generation ([Note: buffers in a decided exchange])."""
        assert self._buffers is not None and self._current is not None
        group = self._current.topology.outer
        if group is None:  # no counterpart in the other islands: it keeps its own, as with DiLoCo (see the note)
            return None, []
        works: list[dist.Work] = []
        try:
            return self._buffers.average_in_rank_order(mine, group, self.decider.wait, works), []
        except RuntimeError as error:
            self.abandoned.extend(works)
            return None, [f"averaging the buffers failed: {error}"]

    def _decided(
        self,
        delta: torch.Tensor,
        residuals: Residuals | None,
        with_buffers: bool = False,
        described: Described | None = None,
    ) -> Averaged:
        """The average the current generation agreed on; values None when this process must join again."""
        assert self._attempt is not None, "an exchange landed that never started"
        attempt, self._attempt = self._attempt, None
        retried_with_all_alive = False
        mine = self._buffers.snapshot() if with_buffers and self._buffers is not None else None
        while True:
            step, members = self._outer_step(), list(self.decider.run.member_generation.members)
            averaged, failures, verdict = attempt.result()  # the thread's try never raises: it returns its failure
            buffers = None
            if mine is not None and not failures:
                buffers, failures = self._average_buffers(mine)
            try:
                decision, by_vote = self.decider.decide(step, failures, self._arrivals_known(), self.abandoned)
            except settle.Revoked as revoked:
                self.outcome = Outcome(revoked=revoked)
                return Averaged(None, 1)
            if decision.commit:
                if failures:
                    raise RuntimeError(
                        f"outer step {step} was settled as committed although this replica's exchange failed "
                        f"({failures[0]}), so it never voted: a bug in gradsync.elastic's commit protocol."
                    )
                self.outcome = Outcome(decision, by_vote, verdict=verdict)
                assert averaged is not None
                if buffers is not None and self._buffers is not None:
                    self._buffers.write(buffers)
                return averaged
            if not self._reconfigure(f"outer step {step} aborted: {decision.reason}"):
                self.outcome = Outcome(left_out=True)
                return Averaged(None, 1)
            if set(members) == set(self.decider.run.member_generation.members):
                if retried_with_all_alive:
                    rank = self.decider.run.member_generation.rank_of(self.decider.run.uuid)
                    raise RuntimeError(
                        f"Rank {rank}: outer step {step} "
                        f"failed twice although every replica is alive: {decision.reason}"
                    )
                retried_with_all_alive = True
            self.redone += 1
            # The redo runs here, in the training loop, over the new generation's group: the survivors
            # wait for it (an abort is rare; overlapping it would need a landing step of its own).
            assert self._current is not None
            if described is not None and self.screening is not None:  # the islands of the new generation
                described = (described[0], described[1], *self.screening.islands())
            attempt = _done(self._average_once(self._current, delta, residuals, described))


class DecidedAverage:
    """An outer exchange in flight; ``result()`` (at landing) decides it together with the other replicas."""

    def __init__(self, decide: Callable[[], Averaged]) -> None:
        self._decide: Callable[[], Averaged] | None = decide
        self._value: Averaged | None = None

    def result(self) -> Averaged:
        if self._decide is not None:
            decide, self._decide = self._decide, None
            self._value = decide()
        assert self._value is not None
        return self._value


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future
