"""Taking part in a fault-tolerant run: ``gradsync.elastic.init`` instead of ``init_process_group``.

The first ``replicas`` processes to arrive at the store found generation 0 together; any later
one (a replacement restarted by its launcher, or started by hand) is a joiner: it gets a
one-process default group so that its model can be wrapped meanwhile, and ``FaultTolerant``
then waits until the members admit it at a committed step and heals it.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import membership
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
    history: list[dict] = field(default_factory=list)  # one entry per reconfiguration

    @property
    def joining(self) -> bool:
        return self.generation is None

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
        """Raise when ``generation`` holds nobody with the training state, or fewer than ``min_replicas``."""
        if not generation.healthy:
            raise RuntimeError(
                f"gradsync.elastic: no member holding the training state is left in generation {generation.number} "
                "(every one of them died while joiners were being healed); restart from a checkpoint."
            )
        if len(generation.members) < self.min_replicas:
            dead = [rank for rank, uuid in enumerate(candidates) if uuid not in generation.members]
            raise RuntimeError(
                f"Rank(s) {dead} of generation {generation.number - 1} died (or stopped answering) and only "
                f"{len(generation.members)} replica(s) remain, fewer than min_replicas={self.min_replicas}. "
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
) -> ElasticRun:
    """Join run ``run_id`` through the store at ``store``; returns this process's place.

    ``store``: ``host:port`` (a TCPStore, ``python -m gradsync.elastic.store``) or
    ``etcd://h1:2379,h2:2379,h3:2379`` (an etcd cluster, replicated: [Note: a store that survives
    losing a machine] in etcd_store.py).

    Defaults come from the environment: ``GRADSYNC_STORE``, ``GRADSYNC_RUN_ID`` (else "run"),
    ``GRADSYNC_REPLICAS``. ``timeout_s`` bounds every collective (a hung peer is noticed sooner,
    after ``heartbeat_timeout_s`` without a heartbeat); ``min_replicas``: fewer survivors than this
    end the run with an error naming the dead ranks.
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
    index = run.arrive()
    if index <= count:
        run.generation = _found(run)
        run.arrivals_seen = count
        membership.open_group(client, keys, run.generation, me, timeout_s)
        heartbeat.watch(run.generation.members)
    else:
        membership.open_alone(client, keys, me)
    _current = run
    return run


def _found(run: ElasticRun) -> Generation:
    """Generation 0: the first ``replicas`` arrivals, in arrival order."""
    deadline = time.monotonic() + run.join_timeout_s
    keys = [run.keys.arrival(i) for i in range(1, run.replicas + 1)]
    while not run.store.check(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only some of the {run.replicas} replicas reached the store at {run.address} within "
                f"{run.join_timeout_s:.0f}s; start them all (or lower replicas)."
            )
        time.sleep(0.05)
    members = [run.store.get(k).decode() for k in keys]
    return Generation(0, members, 0, members)


def current() -> ElasticRun:
    if _current is None:
        raise RuntimeError("call gradsync.elastic.init(...) before FaultTolerant(...).")
    return _current
