"""One decision per step, in the store: every member applies the optimizer step, or none does.

[Note: commit]
After a kill, survivors can disagree on whether the last collective completed (NOTES, exp3:
1 in 25 random kills). So no rank steps on local success alone. Each member whose reductions all
completed counts itself in with ``add(ok, 1)``; the one that brings the count to the group size
writes ``commit`` with ``compare_set``; a member whose reduction failed, or that sees a member
stop beating first, writes ``abort``. The first value written wins and every member acts on it.
Costs two store round trips per member and step (about 0.1 ms each on an idle loopback).

The committing member also admits the joiners that arrived since the last admission (it looks
at most twice a second); the decision names them, so every member starts the same next
generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from .heartbeat import Heartbeat
from .keys import Keys

QUICK_TIMEOUT = timedelta(seconds=0.5)  # how often a member waiting for the decision looks at the heartbeats


@dataclass(frozen=True)
class Decision:
    commit: bool
    admit: list[str] = field(default_factory=list)
    arrivals_seen: int = 0  # arrivals up to this index have been admitted (or were members)
    reason: str = ""


def decide(
    store: dist.Store,
    quick: dist.Store,
    keys: Keys,
    generation: int,
    step: int,
    members: list[str],
    ok: bool,
    failure: str,
    arrivals_seen: int,
    heartbeat: Heartbeat,
    look_for_joiners: bool,
) -> Decision:
    """Two store round trips per member when the step commits. ``quick``: a client of the same store
    whose ``get`` gives up after a short timeout, so that a member waiting for the decision keeps an
    eye on the heartbeats. ``look_for_joiners``: whether the deciding member checks for arrivals."""
    key = keys.decision(generation, step)
    if not ok:
        return _propose(store, key, Decision(False, [], arrivals_seen, failure))
    if store.add(keys.ok(generation, step), 1) == len(members):
        admit, seen = [], arrivals_seen
        if look_for_joiners:
            seen = max(store.add(keys.arrivals, 0), arrivals_seen)
            admit = [store.get(keys.arrival(i)).decode() for i in range(arrivals_seen + 1, seen + 1)]
        return _propose(store, key, Decision(True, admit, seen))
    while True:
        try:
            # get() blocks until the key is set: answered as soon as the deciding member writes it. One
            # that times out (a member is slow or gone) logs a line from torch's C++ client.
            return Decision(**json.loads(quick.get(key)))
        except dist.DistStoreError:
            gone = heartbeat.stale() & set(members)
            if gone:
                return _propose(
                    store, key, Decision(False, [], arrivals_seen, f"members {sorted(gone)} stopped beating")
                )


def _propose(store: dist.Store, key: str, decision: Decision) -> Decision:
    """Write ``decision`` unless one was written first; the one that stands."""
    return Decision(**json.loads(store.compare_set(key, "", json.dumps(decision.__dict__))))


def aborted(store: dist.Store, keys: Keys, generation: int, step: int) -> bool:
    """Whether some member already decided this step will not commit."""
    key = keys.decision(generation, step)
    return store.check([key]) and not json.loads(store.get(key))["commit"]
