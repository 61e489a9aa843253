"""Heartbeats: every trainer counts up a key; a peer whose count stops is dead or hung.

A counter rather than a timestamp, so clocks of different machines never get compared: each
process notes, on its own clock, when it last saw a peer's count change. A SIGSTOPped process
stops beating like a dead one. One thread per process beats and watches on its own store
connection, so a main thread stuck in a collective does not stop it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta

from .keys import Keys
from .tcp_store import connect


class Heartbeat:
    def __init__(self, address: str, keys: Keys, uuid: str, period_s: float, timeout_s: float) -> None:
        self._store = connect(address, timedelta(seconds=max(2.0, timeout_s)))
        self._keys = keys
        self.uuid = uuid
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}  # uuid -> (last count, when it last changed)
        self._watched: set[str] = set()
        self._stop = threading.Event()
        self._store.add(keys.heartbeat(uuid), 1)  # beating before anyone can look for it
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, uuids: Iterable[str]) -> None:
        """Watch these peers (and only these) from now on; a new one gets a full timeout of grace."""
        with self._lock:
            self._watched = set(uuids) - {self.uuid}
            now = time.monotonic()
            for uuid in self._watched:
                self._seen.setdefault(uuid, (-1, now))

    def stale(self) -> set[str]:
        """Watched peers whose count has not changed for ``timeout_s``."""
        now = time.monotonic()
        with self._lock:
            return {u for u in self._watched if now - self._seen[u][1] > self.timeout_s}

    def alive(self, uuid: str) -> bool:
        return uuid == self.uuid or uuid not in self.stale()

    def _run(self) -> None:
        key = self._keys.heartbeat(self.uuid)
        try:
            while not self._stop.wait(self.period_s):
                self._store.add(key, 1)
                with self._lock:
                    watched = list(self._watched)
                counts = {u: self._store.add(self._keys.heartbeat(u), 0) for u in watched}
                now = time.monotonic()
                with self._lock:
                    for uuid, count in counts.items():
                        last = self._seen.get(uuid)
                        if last is None or last[0] != count:
                            self._seen[uuid] = (count, now)
        except Exception:  # noqa: BLE001 - the store is gone: the run is over, nothing to beat for
            return

    def stop(self) -> None:
        """Stop beating (peers see this process as gone after their timeout)."""
        self._stop.set()
        self._thread.join(timeout=self.period_s + 2.0)
