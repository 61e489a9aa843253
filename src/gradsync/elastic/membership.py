"""Generations: who trains together, agreed in the store, and the process group they share.

[Note: forming a generation]
A generation is a list of trainer uuids (rank = position), the committed step it starts at, and
which of its members hold the current training state (the others are joiners, to be healed).
It is formed from a list of candidates every one of them knows (the previous generation, plus
the joiners a commit decision admitted):
1. every live candidate writes ``present``;
2. each waits until every candidate is present or has stopped beating (or twice ``timeout_s``
   passed: a live one blocked in a collective is out of it within one);
3. each then proposes the present candidates with ``compare_set``: the first proposal written
   is the generation, and everybody reads it back;
4. the members open the generation's process group, on a key prefix of its own in the store.
A candidate that comes too late is not a member: it is still alive, so it joins again and is
healed (``FaultTolerant``); so is one whose last step was revoked (elastic/settle.py), which
says so in ``present`` at once rather than make the others wait. A member that dies while the
group opens makes the opening time out; the others form the next generation from this one.

The group becomes the default process group (``dist.group.WORLD``), so every collective
gradsync and the user issue without a group follows the generation. The previous group is kept
alive, not destroyed by its last reference: dropping a gloo group with an operation stuck on a
hung peer blocks until that operation times out (shared/fault-tolerance NOTES, exp5).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import islands
from .heartbeat import Heartbeat
from .keys import Keys

# Process groups of earlier generations: never dropped (see the note); one per reconfiguration.
_graveyard: list[Any] = []
_POLL_S = 0.005
_DECLINED = b"0"  # the ``present`` value of a candidate that will not be a member (it joins again)


@dataclass(frozen=True)
class Generation:
    number: int
    members: list[str]
    step: int  # committed steps when it formed
    healthy: list[str]  # members holding the current state; the first one is the heal source
    # each member's island ([Note: membership by island] in islands.py); empty: every member is its own
    islands: list[str] = field(default_factory=list)

    def rank_of(self, uuid: str) -> int:
        return self.members.index(uuid)

    @property
    def source(self) -> int:
        return self.members.index(self.healthy[0])

    def island_of(self, uuid: str) -> str:
        return self.islands[self.members.index(uuid)] if self.islands else uuid

    def island_ranks(self) -> list[list[int]]:
        """Each island's global ranks (contiguous), islands in member order."""
        names = self.islands or self.members
        grouped: list[list[int]] = []
        for rank, name in enumerate(names):
            if rank and names[rank - 1] == name:
                grouped[-1].append(rank)
            else:
                grouped.append([rank])
        return grouped

    @property
    def named_islands(self) -> bool:
        """Whether any member trains in an island named by the user (else every member is a plain replica)."""
        return any(name != uuid for name, uuid in zip(self.islands, self.members))

    def island_names(self) -> list[str]:
        names = self.islands or self.members
        return [names[ranks[0]] for ranks in self.island_ranks()]

    def mates(self, uuid: str) -> list[str]:
        """The other members of ``uuid``'s island."""
        name = self.island_of(uuid)
        return [m for m in self.members if m != uuid and self.island_of(m) == name]


def form(
    store: dist.Store,
    keys: Keys,
    number: int,
    candidates: list[str],
    healthy: list[str],
    step: int,
    me: str,
    heartbeat: Heartbeat,
    timeout_s: float,
) -> Generation:
    """Steps 1-3 of [Note: forming a generation]; the caller checks whether it is a member."""
    store.set(keys.present(number, me), "1")
    heartbeat.watch(candidates)
    # A live candidate may be blocked in a collective (a broadcast before forward waits for its full
    # timeout): it is still beating and is here within one timeout. Twice that is the safety net.
    deadline = time.monotonic() + 2 * timeout_s
    decided = keys.members(number)
    while not store.check([decided]):
        waiting = [c for c in candidates if not store.check([keys.present(number, c)])]
        gone = out_of_reach(store, keys, heartbeat, waiting)
        if all(c in gone for c in waiting) or time.monotonic() > deadline:
            present = [c for c in candidates if c not in waiting and store.get(keys.present(number, c)) != _DECLINED]
            seats = islands.reader(store, keys)
            present = islands.whole(present, seats)  # an island is in as a whole or not at all
            names = [seats(c).island for c in present]
            proposal = Generation(number, present, step, [h for h in healthy if h in present], names)
            store.compare_set(decided, "", json.dumps(asdict(proposal)))
            break
        time.sleep(0.02)
    return Generation(**json.loads(store.get(decided)))


def out_of_reach(store: dist.Store, keys: Keys, heartbeat: Heartbeat, uuids: list[str]) -> set[str]:
    """Those of ``uuids`` not to wait for: they stopped beating, or left the run on purpose."""
    return (heartbeat.stale() & set(uuids)) | {u for u in uuids if store.check([keys.left(u)])}


def decline(store: dist.Store, keys: Keys, number: int, me: str) -> None:
    """Tell the candidates forming generation ``number`` not to wait for this process: it joins again."""
    store.set(keys.present(number, me), _DECLINED.decode())  # stored as these bytes


def bury(thing: Any) -> None:
    """Keep ``thing`` (a group, a reducer holding work handles) alive for the rest of the process."""
    _graveyard.append(thing)


def release_graveyard() -> None:
    """At exit: free the old groups while the interpreter still runs (their threads are joined
    here; freed during interpreter teardown instead, they end the process with std::terminate)."""
    _graveyard.clear()
    gc.collect()


def read(store: dist.Store, keys: Keys, number: int) -> Generation:
    return Generation(**json.loads(store.get(keys.members(number))))


def open_group(store: dist.Store, keys: Keys, generation: Generation, me: str, timeout_s: float) -> None:
    """Make ``generation``'s group the default group (step 4); raises if a member never shows up."""
    if dist.is_initialized():
        _graveyard.append(dist.group.WORLD)
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(keys.group_prefix(generation.number), store),
        rank=generation.rank_of(me),
        world_size=len(generation.members),
        timeout=timedelta(seconds=timeout_s),
    )


def world() -> dist.ProcessGroup:
    """The current default group: the generation's (``open_group``), or a joiner's own (``open_alone``)."""
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError(
            "gradsync.elastic used the default process group before it was made: gradsync.elastic.init() "
            "opens it (and every new generation reopens it), before FaultTolerant or FaultTolerantDiLoCo."
        )
    return group


def open_alone(store: dist.Store, keys: Keys, me: str) -> None:
    """A one-process default group for a joiner until it is admitted (its DDP can be built meanwhile)."""
    if dist.is_initialized():
        _graveyard.append(dist.group.WORLD)
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{keys.root}/alone/{me}/", store), rank=0, world_size=1)


def await_generation(store: dist.Store, keys: Keys, number: int, me: str, deadline: float) -> Generation:
    """A joiner's side of forming generation ``number``: say it is present, read what the members decide."""
    store.set(keys.present(number, me), "1")
    while not store.check([keys.members(number)]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"generation {number} was never formed: the members it was admitted by are gone.")
        time.sleep(0.02)
    return read(store, keys, number)
