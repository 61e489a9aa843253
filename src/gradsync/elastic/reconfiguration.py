"""Changing a fault-tolerant run's membership: forming the next generation and healing it, a joiner's
way in, and the history entry every change leaves.

``gradsync.elastic.FaultTolerant`` (decides each DDP step) and ``gradsync.elastic_diloco.FaultTolerantDiLoCo``
(decides each outer step) change membership the same way; what they differ in -- what a heal moves,
which step counts, what the history entry adds -- comes in as callables.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import membership
from .island_watch import IslandLost
from .membership import Generation
from .run import ElasticRun

logger = logging.getLogger(__name__)

# (the generation just formed, whether a step was aborted): open its group and make its state one
OpenAndHeal = Callable[[Generation, bool], None]
# (candidates, the generation formed, the reason, aborted): raise when the run cannot go on with it
CheckFormed = Callable[[list[str], Generation, str, bool], None]


class Reconfiguration:
    """Forms and heals generations for one fault-tolerant trainer; ``name`` prefixes its log lines."""

    def __init__(
        self,
        run: ElasticRun,
        name: str,
        open_and_heal: OpenAndHeal,
        committed_step: Callable[[], int],
        describe: Callable[[], dict[str, Any]],
        after: Callable[[], None],
        check: CheckFormed | None = None,
    ) -> None:
        self.run = run
        self.name = name
        self._open_and_heal = open_and_heal
        self._committed_step = committed_step  # the step the generation is formed at (its joiners are healed to it)
        self._describe = describe  # the trainer's own fields of a history entry
        self._after = after  # runs after every change: the trainer calls its user's on_reconfigure
        self._check = check

    def change(self, candidates: list[str], healthy: list[str], reason: str, aborted: bool = False) -> bool:
        """Form the next generation from ``candidates`` and heal it, forming again while members die doing
        so; False if this process was left out of it (the caller joins again: ``rejoin``)."""
        run = self.run
        started = time.monotonic()
        number = run.member_generation.number + 1
        while True:
            generation = membership.form(
                run.store, run.keys, number, candidates, healthy, self._committed_step(), run.uuid, run.heartbeat,
                run.timeout_s,
            )  # fmt: skip
            if run.uuid not in generation.members:
                logger.warning("%s: left out of generation %d; joining again", self.name, number)
                return False
            if self._check is not None:
                self._check(candidates, generation, reason, aborted)
            run.check_enough(candidates, generation)
            try:
                self._open_and_heal(generation, aborted)
                break
            except RuntimeError as error:  # a member died while the group opened or the state moved
                logger.warning("%s: generation %d failed to form (%s); retrying", self.name, number, error)
                candidates, healthy, number = generation.members, generation.healthy, generation.number + 1
        self.record(reason, candidates, started)
        return True

    def join(self) -> None:
        """A joiner's way in: wait until the members admit it at a committed step, then form the
        generation with them and be healed; left out again, it arrives anew and waits again."""
        while True:
            started = time.monotonic()
            generation = self.run.await_admission()
            if generation is None:
                self._island_cannot_rejoin()
                self.run.start_over()
                continue
            try:
                self._open_and_heal(generation, False)
            except RuntimeError as error:
                logger.warning(
                    "%s: healing in generation %d failed (%s); retrying", self.name, generation.number, error
                )
                self.run.generation = generation
                if self.change(generation.members, generation.healthy, "a heal failed"):
                    return
                self._island_cannot_rejoin()
                self.run.start_over()
                continue
            self.record("joined and healed", generation.members, started)
            return

    def rejoin(self) -> None:
        """Left out (or revoked): alone again, arrived anew, admitted and healed. A member of an island of
        several cannot: its island is no longer whole, so it ends ([Note: membership by island] in islands.py)."""
        self._island_cannot_rejoin()
        self.run.start_over()
        self.join()

    def _island_cannot_rejoin(self) -> None:
        seat = self.run.seat
        if seat is not None and seat.size > 1:
            raise IslandLost(
                f"{self.name}: island {seat.island!r} (this process: its rank {seat.rank} of {seat.size}) was left out "
                "of the run's next generation: some member of it was not there (dead, hung or too late), and an "
                "island is in as a whole or not at all. This process ends so that its launcher restarts the whole "
                "island (torchrun --max-restarts); the other islands admit and heal it then."
            )

    def record(self, reason: str, candidates: list[str], started: float) -> None:
        """The history entry of the change that just formed ``run.generation``; then ``after``."""
        generation = self.run.member_generation
        joiners = len(generation.healthy) < len(generation.members)
        entry = {
            "generation": generation.number,
            "reason": reason,
            "world_size": len(generation.members),
            "members": list(generation.members),
            "left_out": [c for c in candidates if c not in generation.members],
            "healed_from": generation.healthy[0] if joiners else None,
            **self._describe(),
            "seconds": time.monotonic() - started,
        }
        self.run.history.append(entry)
        logger.info("%s: %s", self.name, entry)
        self._after()
