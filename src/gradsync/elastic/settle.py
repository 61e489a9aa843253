"""Settling a step through the store, when its vote could not decide it (a failure, a death).

[Note: settling a step]
A vote can complete on some members and fail on others (a member dies while the last messages
travel): the first ones committed the step and went on, the others do not know. So a member
that cannot decide its step by the vote (commit.py) settles it:
1. it sets the generation's ``trouble`` key, so that every member waiting on this generation's
   collectives gives up within one slice of its wait and settles too;
2. if it committed the previous step by a vote, it writes that commit as the previous step's
   decision (``compare_set``): if an abort stands there instead, this member was taken for dead
   while it committed, its step is revoked and it joins again (its state is healed);
3. it publishes its *word*: how many steps it committed, whether it holds this step's local
   gradients, and the decision it applied last;
4. it waits until every other member published a word at least at this step, or stopped
   beating, or left (at most twice the collective timeout), then proposes: a member one step
   ahead committed this step by a vote, so it commits (with that member's joiners); else it
   aborts. The first proposal written (``compare_set``) is the step's decision for everybody.
An abort says whether the step can be redone: only if every member holds its local gradients
(one that just settled the previous step as a commit has none yet; then the step's batches are
dropped and ``FaultTolerant.step()`` returns False).
Only a member that was silent past the heartbeat timeout right after its vote completed can be
revoked: a dead member's commit does not matter, and a live one is waited for.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from .commit import Decision, propose
from .heartbeat import Heartbeat
from .keys import Keys
from .membership import Generation, out_of_reach

_POLL_S = 0.02


@dataclass(frozen=True)
class Word:
    """What a settling member says of itself (step 3 of the note)."""

    step: int  # committed steps so far: it is deciding step ``step``
    grads: bool  # it holds the local gradients of step ``step``
    last: dict[str, Any] | None  # the decision of step ``step - 1`` it applied, if it was made in this generation

    def last_decision(self) -> Decision:
        """The decision of step ``step - 1`` of a member ahead (it committed by a vote in this generation)."""
        if self.last is None:
            raise RuntimeError(
                f"a member published step {self.step} without the decision of step {self.step - 1}: a word one "
                "step ahead comes from applying that step's vote (StepDecider.applied) or from settling the "
                "next step after it, and both carry it."
            )
        return Decision(**self.last)


class Revoked(Exception):
    """This member's last committed step was aborted by the others (step 2 of the note)."""


def publish(store: dist.Store, keys: Keys, generation: int, me: str, word: Word) -> None:
    store.set(keys.word(generation, me), json.dumps(asdict(word)))


def settle(
    store: dist.Store,
    keys: Keys,
    generation: Generation,
    step: int,
    me: str,
    last_vote: Decision | None,
    arrivals_seen: int,
    failure: str,
    heartbeat: Heartbeat,
    timeout_s: float,
) -> Decision:
    """The standing decision of ``step`` in ``generation`` (steps 1-4 of the note).

    ``last_vote``: the commit of step ``step - 1`` if this member decided it by a vote in this
    generation. Raises ``Revoked`` when that commit was overruled.
    """
    number = generation.number
    store.set(keys.trouble(number), "1")
    if last_vote is not None and not propose(store, keys.decision(number, step - 1), last_vote).commit:
        raise Revoked(f"step {step - 1} was aborted by the other members")
    mine = Word(step, True, asdict(last_vote) if last_vote is not None else None)
    publish(store, keys, number, me, mine)
    key = keys.decision(number, step)
    others = [m for m in generation.members if m != me]
    deadline = time.monotonic() + 2 * timeout_s
    while not store.check([key]):
        gone = out_of_reach(store, keys, heartbeat, others)
        words = {m: _word(store, keys, number, m) for m in others if m not in gone}
        waiting = [m for m, word in words.items() if word is None or word.step < step]
        if waiting and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            continue
        live = [mine] + [word for word in words.values() if word is not None and word.step >= step]
        ahead = [word for word in live if word.step > step]
        if ahead:  # it committed ``step`` by a vote: so does everybody
            proposal = ahead[0].last_decision()
        else:
            proposal = Decision(False, [], arrivals_seen, failure, redo=all(word.grads for word in live))
        return propose(store, key, proposal)
    return Decision.decoded(store.get(key))


def _word(store: dist.Store, keys: Keys, generation: int, member: str) -> Word | None:
    key = keys.word(generation, member)
    return Word(**json.loads(store.get(key))) if store.check([key]) else None
