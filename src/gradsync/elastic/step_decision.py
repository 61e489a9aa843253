"""How ``FaultTolerant`` decides each step, and how it waits on the group meanwhile.

``StepDecider`` holds what deciding needs from one step to the next: the commit the last vote
made (settling the next step proposes it again: [Note: settling a step] in settle.py), the
store's error once a wait gave up on it, and whether the last vote said some member's store went
silent ([Note: commit] in commit.py). Its ``wait`` is every wait on the group's collectives in
this mode (the buckets', the vote's): in slices, giving up as soon as a member stops beating or
another one settles.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..engine.results import wait_for
from . import commit, settle
from .run import ElasticRun

_SLICE_S = 0.1  # how often a wait for a bucket looks at its peers' heartbeats
_FIRST_POLL_S, _MAX_POLL_S = 0.0001, 0.002  # polling a comm hook's future
_ALL_FINITE = 2**62  # a rank's slot in the vote when its gradients are finite (above any parameter index)


class StepDecider:
    def __init__(self, run: ElasticRun) -> None:
        self.run = run
        self._last_vote: tuple[tuple[int, int], commit.Decision] | None = None  # (generation, step), its commit
        self._store_lost: Exception | None = None  # the store's error, if a wait gave up on it
        self._store_silent = False  # the last vote said some member's store went silent
        # The last vote's ranks with non-finite gradients -> their first such parameter's index
        # (reject_nonfinite only: [Note: non-finite gradients] in nonfinite.py).
        self.nonfinite: dict[int, int] = {}

    def decide(
        self,
        step: int,
        failures: list[str],
        arrivals_known: int,
        abandoned: list[Any],
        reject_nonfinite: bool = False,
        nonfinite_at: int | None = None,
    ) -> tuple[commit.Decision, bool]:
        """Step ``step``'s decision, and whether the vote made it (else it was settled in the store).

        ``failures``: this member's failed collectives of the step (then it does not vote). Raises
        ``settle.Revoked`` when the others aborted the previous step this member committed.
        ``reject_nonfinite``: the vote also carries ``nonfinite_at`` (the index of this member's first
        parameter whose gradient must be left out, None if none); a vote that finds one on any rank
        decides no commit, and ``self.nonfinite`` says which ranks and parameters.
        """
        run, generation = self.run, self.run.member_generation
        self._store_silent = False
        self.nonfinite = {}
        failures = list(failures)
        if not failures:
            try:
                silent = run.heartbeat.unanswered(run.heartbeat.timeout_s) is not None
                slots = _slots(nonfinite_at) if reject_nonfinite else None
                fewest, self._store_silent = commit.vote(arrivals_known, silent, self.wait, abandoned, slots)
                self.nonfinite = {rank: at for rank, at in enumerate(slots or []) if at < _ALL_FINITE}
                if self.nonfinite:
                    reason = f"non-finite gradients on rank(s) {sorted(self.nonfinite)}"
                    return commit.Decision(False, [], run.arrivals_seen, reason), True
                return commit.committed(run.store, run.keys, run.arrivals_seen, fewest, generation.members), True
            except RuntimeError as error:
                failures.append(str(error))
        if self._store_lost is not None:  # a wait gave up on the store: settling would wait for it once more
            raise self._store_lost
        voted = self._last_vote  # the previous step's commit, if a vote made it in this generation
        last = voted[1] if voted is not None and voted[0] == (generation.number, step - 1) else None
        decision = settle.settle(
            run.store, run.keys, generation, step, run.uuid, last, run.arrivals_seen, "; ".join(failures),
            run.heartbeat, run.timeout_s,
        )  # fmt: skip
        return decision, False

    def applied(self, step: int, decision: commit.Decision, by_vote: bool) -> None:
        """Step ``step`` was committed with ``decision`` and applied here."""
        run, generation = self.run, self.run.member_generation
        self._last_vote = ((generation.number, step), decision) if by_vote else None
        if decision.admit or not by_vote:
            # Leaving this generation now: a member still settling the step learns it committed.
            word = settle.Word(step + 1, False, asdict(decision))
            settle.publish(run.store, run.keys, generation.number, run.uuid, word)

    def forget_vote(self) -> None:
        self._last_vote = None

    def wait_for_a_silent_store(self) -> None:
        """After a commit: if the vote said some member's store went silent, every member waits for
        the store here, up to its own timeout, and raises what it says (a lost quorum) rather than
        train on unprotected."""
        if self._store_silent:
            self.run.store.check([self.run.keys.trouble(self.run.member_generation.number)])

    # ------------------------------------------------------------------ waiting on the group
    def wait(self, pending: Any) -> Any:
        """Wait for one bucket (or the vote), giving up as soon as a member stops beating or another settles.

        No completion callback: a Python callback run by gloo's thread on a failed work has been
        seen to end the process (terminate on gloo::IoException); waiting in slices has not.
        """
        if isinstance(pending, dist.Work):
            while True:
                try:
                    pending.wait(timedelta(seconds=_SLICE_S))
                    return None
                except RuntimeError as error:
                    if "timed out" not in str(error).lower():
                        raise
                self._check_peers()
        poll, checked = _FIRST_POLL_S, time.monotonic()
        while not pending.done():
            time.sleep(poll)
            poll = min(2 * poll, _MAX_POLL_S)
            if time.monotonic() - checked > _SLICE_S:
                self._check_peers()
                checked = time.monotonic()
        return wait_for(pending)

    def _check_peers(self) -> None:
        run, generation = self.run, self.run.member_generation
        gone = run.heartbeat.stale() & set(generation.members)
        if gone:
            ranks = sorted(generation.rank_of(u) for u in gone)
            raise RuntimeError(f"rank(s) {ranks} stopped beating; their collectives are abandoned")
        try:
            troubled = run.store.check([run.keys.trouble(generation.number)])
        except dist.DistStoreError as error:  # it did not answer within its own timeout: fatal (see decide)
            self._store_lost = error
            raise
        if troubled:
            raise RuntimeError("another member is settling this step (a collective or a vote failed there)")


def _slots(nonfinite_at: int | None) -> list[int]:
    """This member's part of the vote's per-rank slots: its own value in its slot, the largest in the others'."""
    slots = [_ALL_FINITE] * dist.get_world_size()
    slots[dist.get_rank()] = _ALL_FINITE if nonfinite_at is None else nonfinite_at
    return slots
