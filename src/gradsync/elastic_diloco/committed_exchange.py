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
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..diloco.error_feedback import Residuals
from ..diloco.exchange import Averaged, OuterExchange, WireCount
from ..diloco.topology import Topology
from ..diloco.wire import WireFormat
from ..elastic import commit, membership, settle
from ..elastic.step_decision import StepDecider


@dataclass(frozen=True)
class Outcome:
    """How the last exchange ended for this process; acted on once DiLoCo has applied the outer step."""

    decision: commit.Decision | None = None  # committed (with the joiners it admits), or None
    by_vote: bool = True  # False: settled in the store; the generation's group is broken
    revoked: settle.Revoked | None = None  # this process's last commit was overruled: it joins again
    left_out: bool = False  # the survivors formed a generation without this process: it joins again


class CommittedExchange:
    """What ``DiLoCo`` calls to average an outer gradient (start / finished / close / count)."""

    def __init__(
        self,
        decider: StepDecider,
        wire: WireFormat,
        outer_step: Callable[[], int],
        arrivals_known: Callable[[], int],
        reconfigure: Callable[[str], bool],
    ) -> None:
        self.decider = decider
        self.wire = wire
        self.count = WireCount()
        self._outer_step = outer_step  # committed outer steps so far: the one deciding is the next
        self._arrivals_known = arrivals_known
        self._reconfigure = reconfigure  # forms the next generation of the live members; False: left out
        self._current: OuterExchange | None = None
        # Work handles of failed collectives and votes, kept for the life of the process: freeing
        # one whose gloo pair saw its peer die can end the process (elastic/commit.py).
        self.abandoned: list = []
        membership.bury(self.abandoned)
        self.outcome: Outcome | None = None
        self.redone = 0  # exchanges averaged again after an abort, over the life of the run

    def rebind(self, topology: Topology) -> None:
        """Exchange over ``topology`` (the current generation's group) from now on."""
        self._current = OuterExchange(topology, self.wire, overlap=False, count=self.count, waiter=self.decider.wait)

    def start(
        self, delta: torch.Tensor, flags: tuple[float, float] | None = None, residuals: Residuals | None = None
    ) -> Future[Averaged]:
        if flags is not None:
            raise RuntimeError(
                "outer.join() (uneven inputs) is not supported by FaultTolerantDiLoCo: a replica whose data ends "
                "can call close() instead; the others go on without it (it is not taken for dead: it left)."
            )
        self.count.in_flight += 1
        self.count.peak_in_flight = max(self.count.peak_in_flight, self.count.in_flight)
        future: Future[Averaged] = Future()
        future.set_result(self._average(delta, residuals))
        return future

    def finished(self) -> None:
        self.count.in_flight -= 1

    def close(self) -> None:
        pass  # no thread: the exchange runs in the training loop (delay = 0)

    def take_outcome(self) -> Outcome | None:
        outcome, self.outcome = self.outcome, None
        return outcome

    def _average(self, delta: torch.Tensor, residuals: Residuals | None) -> Averaged:
        """The average the current generation agreed on; values None when this process must join again."""
        retried_with_all_alive = False
        while True:
            assert self._current is not None, "rebind() before the first exchange"
            step, members = self._outer_step(), list(self.decider.run.generation.members)
            failures: list[str] = []
            averaged = None
            try:
                # a redo starts from the same residuals: they are committed only with the applied average
                averaged = self._current.average(delta, None, residuals)
            except RuntimeError as error:
                failures.append(f"the outer exchange failed: {error}")
                self.abandoned.extend(self._current.works)
            finally:
                self._current.works.clear()
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
                self.outcome = Outcome(decision, by_vote)
                assert averaged is not None
                return averaged
            if not self._reconfigure(f"outer step {step} aborted: {decision.reason}"):
                self.outcome = Outcome(left_out=True)
                return Averaged(None, 1)
            if set(members) == set(self.decider.run.generation.members):
                if retried_with_all_alive:
                    raise RuntimeError(
                        f"Rank {self.decider.run.generation.rank_of(self.decider.run.uuid)}: outer step {step} "
                        f"failed twice although every replica is alive: {decision.reason}"
                    )
                retried_with_all_alive = True
            self.redone += 1
