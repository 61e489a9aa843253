"""Taking part in a fault-tolerant run: ``gradsync.elastic.init`` instead of ``init_process_group``.

The first ``replicas`` islands to be whole at the store found generation 0 together (a plain
replica is an island of one: the first ``replicas`` processes); any later process (a replacement
restarted by its launcher, or started by hand) is a joiner: it gets a one-process default group
so that its model can be wrapped meanwhile, and ``FaultTolerant`` (or ``FaultTolerantDiLoCo``)
then waits until the members admit it (its whole island) at a committed step and heals it.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import uuid as uuidlib
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import islands, membership
from .backends import connect
from .heartbeat import Heartbeat
from .keys import Keys
from .membership import Generation

_current: ElasticRun | None = None


@dataclass
class ElasticRun:
    """This process's place in a run: the store, its identity, the current generation."""

    address: str
    run_id: str
    keys: Keys
    store: dist.Store  # a TCPStore or an EtcdStore (backends.py)
    uuid: str
    heartbeat: Heartbeat
    replicas: int
    min_replicas: int
    timeout_s: float
    join_timeout_s: float
    generation: Generation | None  # None while waiting to be admitted
    arrivals_seen: int = 0  # arrivals up to this index are members or were admitted
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per reconfiguration
    seat: islands.Seat | None = None  # this process's island and rank there (a plain replica: its own)
    # The process group of this process's island, when islands are named (``island=``): a DDP over it
    # trains the island's replica. Made for generation ``island_group_of``; a joiner's is its one-process group.
    island_group: dist.ProcessGroup | None = None
    island_group_of: int = -1

    @property
    def island_size(self) -> int:
        return self.seat.size if self.seat is not None else 1

    @property
    def joining(self) -> bool:
        return self.generation is None

    @property
    def member_generation(self) -> Generation:
        """The generation this process is a member of: ``generation``, for the code that runs only once
        this process was founded into a generation or admitted to one."""
        if self.generation is None:
            raise RuntimeError(
                f"gradsync.elastic: process {self.uuid} of run {self.run_id} used its generation before it was "
                "admitted to one: a joiner's FaultTolerant / FaultTolerantDiLoCo steps only after its constructor's "
                "join (await_admission, then the heal) returned."
            )
        return self.generation

    def arrive(self) -> int:
        """Ask to take part (again): returns this arrival's index."""
        index = self.store.add(self.keys.arrivals, 1)
        self.store.set(self.keys.arrival(index), self.uuid)
        return index

    def await_admission(self) -> Generation | None:
        """A joiner's wait: until the members admit it at a commit, then the generation they form with it
        (None when it was left out of that generation: it should ``start_over``)."""
        deadline = time.monotonic() + self.join_timeout_s
        key = self.keys.admitted(self.uuid)
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not admitted to run {self.run_id} within {self.join_timeout_s:.0f}s.")
            time.sleep(0.05)
        number = int(self.store.get(key))
        generation = membership.await_generation(self.store, self.keys, number, self.uuid, deadline)
        if self.uuid not in generation.members:
            return None
        self.generation = Generation(number - 1, [], 0, [])  # the caller forms ``number`` next
        return generation

    def start_over(self) -> None:
        """Left out (or revoked): alone on a one-process group again, arrived anew, to be admitted and healed."""
        self.store.delete_key(self.keys.admitted(self.uuid))
        self.generation = None
        membership.open_alone(self.store, self.keys, self.uuid)
        self.arrive()

    def check_enough(self, candidates: list[str], generation: Generation) -> None:
        """Raise when ``generation`` holds nobody with the training state, or fewer than ``min_replicas``
        (islands: a plain replica is an island of one)."""
        if not generation.healthy:
            raise RuntimeError(
                f"gradsync.elastic: no member holding the training state is left in generation {generation.number} "
                "(every one of them died while joiners were being healed); restart from a checkpoint."
            )
        live = generation.island_names()
        if len(live) < self.min_replicas:
            dead = [rank for rank, uuid in enumerate(candidates) if uuid not in generation.members]
            seats = islands.reader(self.store, self.keys)
            lost = sorted({seats(uuid).island for uuid in candidates if uuid not in generation.members})
            whose = "" if self.island_size == 1 else f" (island(s) {lost}; live: {live})"
            raise RuntimeError(
                f"Rank(s) {dead} of generation {generation.number - 1} died (or stopped answering){whose} and only "
                f"{len(live)} replica(s) remain, fewer than min_replicas={self.min_replicas}. "
                "Start replacements (they join and are healed) or lower min_replicas."
            )

    def leave(self) -> None:
        """Finished on purpose: peers stop waiting for this process at once."""
        try:
            self.store.set(self.keys.left(self.uuid), "1")
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
        self.heartbeat.stop()


def init(
    store: str | None = None,
    run_id: str | None = None,
    replicas: int | None = None,
    min_replicas: int = 1,
    timeout_s: float = 10.0,
    heartbeat_timeout_s: float = 2.0,
    join_timeout_s: float = 600.0,
    *,
    island: str | None = None,
    island_rank: int | None = None,
    island_size: int | None = None,
) -> ElasticRun:
    """Join run ``run_id`` through the store at ``store``; returns this process's place.

    ``store``: ``host:port`` (a TCPStore, ``python -m gradsync.elastic.store``) or
    ``etcd://h1:2379,h2:2379,h3:2379`` (an etcd cluster, replicated: [Note: a store that survives
    losing a machine] in etcd_store.py).

    Defaults come from the environment: ``GRADSYNC_STORE``, ``GRADSYNC_RUN_ID`` (else "run"),
    ``GRADSYNC_REPLICAS``. ``timeout_s`` bounds every collective (a hung peer is noticed sooner,
    after ``heartbeat_timeout_s`` without a heartbeat); ``min_replicas``: fewer survivors than this
    end the run with an error naming the dead ranks.

    ``island``: the name of the island this process trains one replica in, together with others
    (gradsync.elastic_diloco over islands; default ``GRADSYNC_ISLAND``); its rank and size there
    default to torchrun's ``RANK`` and ``WORLD_SIZE`` (launch one torchrun per island). ``replicas``
    and ``min_replicas`` then count islands ([Note: membership by island] in islands.py).
    """
    global _current
    address = store or os.environ.get("GRADSYNC_STORE")
    if not address:
        raise ValueError(
            "gradsync.elastic.init needs the store address: pass store='host:port' (or "
            "'etcd://h1:2379,h2:2379,h3:2379') or set GRADSYNC_STORE."
        )
    count = replicas if replicas is not None else int(os.environ.get("GRADSYNC_REPLICAS", "0"))
    if count < 1:
        raise ValueError("gradsync.elastic.init needs the number of replicas: pass replicas=N or set GRADSYNC_REPLICAS")
    if not 1 <= min_replicas <= count:
        raise ValueError(f"min_replicas must be between 1 and replicas ({count}), got {min_replicas}.")
    keys = Keys(run_id or os.environ.get("GRADSYNC_RUN_ID", "run"))
    client = connect(address, timedelta(seconds=join_timeout_s))
    me = uuidlib.uuid4().hex[:12]
    heartbeat = Heartbeat(address, keys, me, period_s=min(0.2, heartbeat_timeout_s / 5), timeout_s=heartbeat_timeout_s)
    atexit.register(membership.release_graveyard)
    atexit.register(heartbeat.stop)  # out of the store's C++ client before the interpreter goes (runs first)
    run = ElasticRun(
        address,
        keys.root.rsplit("/", 1)[-1],
        keys,
        client,
        me,
        heartbeat,
        count,
        min_replicas,
        timeout_s,
        join_timeout_s,
        None,
    )
    run.seat = islands.seat_for(me, island, island_rank, island_size)
    islands.announce(client, keys, me, run.seat)
    index = run.arrive()
    founding = _found(run, index)
    if founding is not None:
        run.generation, run.arrivals_seen = founding
        membership.open_group(client, keys, run.generation, me, timeout_s)
        heartbeat.watch(run.generation.members)
        if run.generation.named_islands:
            run.island_group, run.island_group_of = island_groups(run.generation, me), 0
    else:
        membership.open_alone(client, keys, me)
        if run.seat.island != me:
            run.island_group = dist.group.WORLD
    _current = run
    return run


def _found(run: ElasticRun, index: int) -> tuple[Generation, int] | None:
    """Generation 0 (the first ``replicas`` islands to be whole, in that order) and the arrivals it handled,
    if this process is in it; None for a joiner."""
    if run.island_size == 1 and index > run.replicas:
        return None  # a plain replica arriving after the founders: a joiner, without waiting
    deadline = time.monotonic() + run.join_timeout_s
    seats = islands.reader(run.store, run.keys)
    arrivals: list[tuple[int, str]] = []
    decided = run.keys.members(0)
    while not run.store.check([decided]):
        arrivals += _new_arrivals(run, len(arrivals))
        founders, _ = islands.complete_arrivals(arrivals, seats, set(), wanted=run.replicas)
        if len({seats(u).island for u in founders}) == run.replicas:
            names = [seats(u).island for u in founders]
            run.store.compare_set(decided, "", json.dumps(asdict(Generation(0, founders, 0, founders, names))))
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only some of the {run.replicas} replicas (islands) reached the store at {run.address} within "
                f"{run.join_timeout_s:.0f}s; start them all (or lower replicas)."
            )
        time.sleep(0.05)
    generation = membership.read(run.store, run.keys, 0)
    if run.uuid not in generation.members:
        return None
    # arrivals up to the first that is no founder are handled: the founders' (joiners come after them)
    members = set(generation.members)
    handled = 0
    for i, uuid in _new_arrivals(run, 0):  # all of them: another founder may have decided before this one read all
        if uuid not in members:
            break
        handled = i
    return generation, handled


def island_groups(generation: Generation, me: str) -> dist.ProcessGroup:
    """Every island's process group over ``generation``'s default group (collective: every member makes every
    island's, in order); returns this process's island's."""
    groups: list[dist.ProcessGroup] = [dist.new_group(ranks) for ranks in generation.island_ranks()]
    mine = generation.rank_of(me)
    return next(group for group, ranks in zip(groups, generation.island_ranks()) if mine in ranks)


def _new_arrivals(run: ElasticRun, after: int) -> list[tuple[int, str]]:
    """Arrivals after index ``after`` whose uuid is written already (an index is taken before its key is set)."""
    found = []
    for i in range(after + 1, run.store.add(run.keys.arrivals, 0) + 1):
        key = run.keys.arrival(i)
        if not run.store.check([key]):
            break
        found.append((i, run.store.get(key).decode()))
    return found


def current() -> ElasticRun:
    if _current is None:
        raise RuntimeError("call gradsync.elastic.init(...) before FaultTolerant(...).")
    return _current
