"""Heartbeats: every trainer counts up a key; a peer whose count stops is dead or hung.

A counter rather than a timestamp, so clocks of different machines never get compared: each
process notes, on its own clock, when it last saw a peer's count change. A SIGSTOPped process
stops beating like a dead one. One thread per process beats and watches on its own store
connection, so a main thread stuck in a collective does not stop it.

[Note: silence is counted only while the store answers]
A peer is stale when its count has not changed for ``timeout_s`` *of observation*: measured up to
this process's last successful round of reads, not up to now. When the store stops answering
for a while (an etcd leader election: 1-2.5 s at etcd's defaults), nobody's beats land, so the
silence of that stretch says nothing about the peers: during it nobody turns stale, and after
it a peer whose count has not moved is given ``grace_s`` (about five beats) to show that it
lives before it is taken for dead. A round that fails is skipped; the thread keeps beating.

Steps that commit do not use the store ([Note: commit]), so training goes on while it does not
answer; ``unanswered`` tells the training thread when that lasted a heartbeat timeout: its vote
says so, and every member then waits for the store itself (a lost etcd quorum, a dead TCPStore
is named within the store's timeout) rather than train on unprotected ([Note: commit]).
The same thread notes the run's arrivals counter (at most twice a second), so that a step's vote
can name the joiners without a store round trip on the training thread ([Note: commit]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta

from .backends import connect
from .keys import Keys

_ARRIVALS_EVERY_S = 0.5


class Heartbeat:
    def __init__(self, address: str, keys: Keys, uuid: str, period_s: float, timeout_s: float) -> None:
        self._store = connect(address, timedelta(seconds=max(2.0, timeout_s)))
        self._keys = keys
        self.uuid = uuid
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}  # uuid -> (last count, when it last changed)
        self._observed = time.monotonic()  # when the last round of reads succeeded
        self.grace_s = min(timeout_s, 5 * period_s)  # after a gap in observation ([Note: silence is counted ...])
        self._watched: set[str] = set()
        self.arrivals_known = 0  # the arrivals counter when last read (it only grows)
        self._arrivals_read = 0.0
        self.last_error: Exception | None = None  # why the last round failed
        self._stop = threading.Event()
        self._beats = 0
        self._beat([])  # beating before anyone can look for it
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, uuids: Iterable[str]) -> None:
        """Watch these peers (and only these) from now on; a new one gets a full timeout of grace."""
        with self._lock:
            before, self._watched = self._watched, set(uuids) - {self.uuid}
            now = time.monotonic()
            for uuid in self._watched - before:  # also one watched before, then not (it rejoins after a hang)
                self._seen[uuid] = (-1, now)

    def stale(self) -> set[str]:
        """Watched peers whose count has not changed for ``timeout_s`` of observation."""
        with self._lock:
            return {u for u in self._watched if self._observed - self._seen[u][1] > self.timeout_s}

    def unanswered(self, limit_s: float) -> Exception | None:
        """The store's last error if it has not answered a round for more than ``limit_s``, else None."""
        with self._lock:
            silent = time.monotonic() - self._observed
        return self.last_error if silent > limit_s else None

    def alive(self, uuid: str) -> bool:
        return uuid == self.uuid or uuid not in self.stale()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._round()
            except Exception as error:  # noqa: BLE001 - no answer in time: nothing observed this round
                self.last_error = error

    def _round(self) -> None:
        """Beat once and read the watched peers' counts (and now and then the arrivals counter)."""
        with self._lock:
            watched = list(self._watched)
        reads = [self._keys.heartbeat(u) for u in watched]
        look = time.monotonic() - self._arrivals_read > _ARRIVALS_EVERY_S
        values = self._beat(reads + [self._keys.arrivals] if look else reads)
        if look:
            self.arrivals_known = values.pop()
            self._arrivals_read = time.monotonic()
        self._note(dict(zip(watched, values)))

    def _beat(self, reads: list[str]) -> list[int]:
        """Count this process's beat up and read ``reads`` (counters; an absent one reads 0). A store
        with ``beat`` does it in one request (etcd: one transaction; the count is this thread's own,
        so a put does); others with ``add``."""
        self._beats += 1
        beat = getattr(self._store, "beat", None)
        if beat is not None:
            return [
                int(v) if v is not None else 0 for v in beat(self._keys.heartbeat(self.uuid), str(self._beats), reads)
            ]
        self._store.add(self._keys.heartbeat(self.uuid), 1)
        return [self._store.add(key, 0) for key in reads]

    def _note(self, counts: dict[str, int]) -> None:
        now = time.monotonic()
        with self._lock:
            gap = now - self._observed > 2 * self.period_s + self.grace_s / 2
            self._observed = now
            for uuid, count in counts.items():
                last = self._seen.get(uuid)
                if last is None or last[0] != count:
                    self._seen[uuid] = (count, now)
                elif gap:  # unobserved for a while: a grace before its silence counts again
                    self._seen[uuid] = (count, max(last[1], now - self.timeout_s + self.grace_s))

    def stop(self) -> None:
        """Stop beating (peers see this process as gone after their timeout)."""
        self._stop.set()
        self._thread.join(timeout=self.period_s + 2.0)
