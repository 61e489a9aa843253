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

A store with a ``vote`` method (etcd_store.py: multi-key transactions) does the count and the
commit in one transaction per member instead: each member writes its own vote key, and the
transaction that finds every other member's vote there (and no decision yet) also writes
``commit``. etcd applies transactions one at a time, so exactly one member is last. Each member
looks for joiners before it votes (at most twice a second), so that the last one can name them.
The decision key, the abort and everything after are the same for both stores.
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
    """Two store round trips per member when the step commits (one transaction, then a read, with a store
    that has ``vote``). ``quick``: a client of the same store
    whose ``get`` gives up after a short timeout, so that a member waiting for the decision keeps an
    eye on the heartbeats. ``look_for_joiners``: whether the deciding member checks for arrivals."""
    key = keys.decision(generation, step)
    if not ok:
        return _propose(store, key, Decision(False, [], arrivals_seen, failure))
    vote = getattr(store, "vote", None)
    if vote is not None:  # one transaction: vote, and commit if this is the last vote ([Note: commit])
        commit = Decision(True, *_arrivals(store, keys, arrivals_seen, look_for_joiners))
        others = [keys.vote(generation, step, m) for m in members if m != heartbeat.uuid]
        if vote(keys.vote(generation, step, heartbeat.uuid), others, key, json.dumps(commit.__dict__)):
            return commit
    elif store.add(keys.ok(generation, step), 1) == len(members):
        return _propose(store, key, Decision(True, *_arrivals(store, keys, arrivals_seen, look_for_joiners)))
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
            # Nobody is stale, yet no answer: ask through the patient client, which waits out a store
            # that does not answer (an etcd election) up to its own timeout and then raises, saying why.
            store.check([key])


def _arrivals(store: dist.Store, keys: Keys, arrivals_seen: int, look: bool) -> tuple[list[str], int]:
    """The joiners to admit with this commit (those that arrived since ``arrivals_seen``), if ``look``."""
    if not look:
        return [], arrivals_seen
    seen = max(store.add(keys.arrivals, 0), arrivals_seen)
    return [store.get(keys.arrival(i)).decode() for i in range(arrivals_seen + 1, seen + 1)], seen


def _propose(store: dist.Store, key: str, decision: Decision) -> Decision:
    """Write ``decision`` unless one was written first; the one that stands."""
    return Decision(**json.loads(store.compare_set(key, "", json.dumps(decision.__dict__))))


def aborted(store: dist.Store, keys: Keys, generation: int, step: int) -> bool:
    """Whether some member already decided this step will not commit."""
    key = keys.decision(generation, step)
    return store.check([key]) and not json.loads(store.get(key))["commit"]
