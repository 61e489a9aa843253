"""One decision per step: every member applies the optimizer step, or none does.

[Note: commit]
After a kill, survivors can disagree on whether the last collective completed (NOTES, exp3:
1 in 25 random kills). So no rank steps on a reduction's local success alone: once its
reductions all completed, a member *votes*, one all-reduce of two integers over the
generation's group. A vote that completes on a member means every member voted, so every
member's reductions completed: the step commits. This is the whole cost of a step that
commits (about what one TCPStore round trip costs; nothing goes through the store, so a
replicated store adds nothing to a step: its writes are Raft entries a majority fsyncs).

A member whose reduction failed does not vote; it *settles* the step through the store
(settle.py), and so does a member whose vote failed or that saw another member start settling
(the generation's ``trouble`` key, read by every wait on this generation's collectives): there,
the standing decision of each step is written once with ``compare_set``. The vote carries the
number of arrivals (would-be joiners) each member knows of: the fewest is what every member
admits with this commit, so they all name the same joiners and form the same next generation.
It also says whether any member's heartbeats have gone unanswered by the store: then every
member, after applying the step, waits for the store at that same point (and raises what it
says if it stays away), so that none waits for it while the others wait in a collective for
it (which would time out there).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import islands
from .keys import Keys


@dataclass(frozen=True)
class Decision:
    commit: bool
    admit: list[str] = field(default_factory=list)
    arrivals_seen: int = 0  # arrivals up to this index have been admitted (or were members)
    reason: str = ""
    # An abort only: whether every member of the next generation holds this step's local
    # gradients, so that they reduce them again; if not, the step's batches are dropped.
    redo: bool = True

    def encoded(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def decoded(cls, value: bytes | str) -> Decision:
        return cls(**json.loads(value))


def vote(
    arrivals_known: int,
    store_silent: bool,
    wait: Callable[[Any], Any],
    abandoned: list[Any],
    per_rank: list[int] | None = None,
) -> tuple[int, bool]:
    """This member's vote: (the fewest arrivals any member knows of, whether any member's store went
    silent), once every member voted.

    ``per_rank`` (``reject_nonfinite``): one more integer per rank, reduced with the rest and written
    back into the list, so that every member learns every rank's value in the same all-reduce. A
    member passes its own value in its slot and the largest in the others' ([Note: non-finite
    gradients] in nonfinite.py). Every member must pass it, or none: the vote's size must match.

    Raises RuntimeError when the vote cannot complete here (a member died, or started settling:
    ``wait`` gives up then). The work handle of a failed vote goes to ``abandoned``: freeing one
    whose gloo pair saw its peer die can end the process.
    """
    slots = per_rank or []  # MIN: the fewest, any silent, each rank's own value
    tally = torch.tensor([arrivals_known, -int(store_silent), *slots], dtype=torch.int64)
    work = None
    try:
        work = dist.all_reduce(tally, op=dist.ReduceOp.MIN, async_op=True)
        wait(work)
    except Exception as error:
        abandoned.append(work)
        raise RuntimeError(f"the commit vote failed: {error}") from error
    if per_rank is not None:
        per_rank[:] = tally[2:].tolist()
    return int(tally[0]), bool(tally[1] < 0)


def committed(
    store: dist.Store, keys: Keys, arrivals_seen: int, fewest_known: int, members: Sequence[str] = ()
) -> Decision:
    """The commit a completed vote decided: it admits the arrivals every member knows of, island by
    island: an island only once all its members arrived ([Note: membership by island] in islands.py)."""
    if fewest_known <= arrivals_seen:
        return Decision(True, [], arrivals_seen)
    arrivals = [(i, store.get(keys.arrival(i)).decode()) for i in range(arrivals_seen + 1, fewest_known + 1)]
    joiners, handled = islands.complete_arrivals(arrivals, islands.reader(store, keys), set(members))
    return Decision(True, joiners, max(arrivals_seen, handled))


def propose(store: dist.Store, key: str, decision: Decision) -> Decision:
    """Write ``decision`` unless one was written first; the one that stands."""
    return Decision.decoded(store.compare_set(key, "", decision.encoded()))
