"""An island's members watch each other: when one dies or hangs, the others exit, so the island restarts whole.

[Note: an island member's death, seen by its mates]
An island's members train one replica over a process group of their own ([Note: membership by
island] in islands.py); without one of them that group, its buckets and (with a sharded
optimizer) its state are of no use, so the others must stop, and their launcher
(``torchrun --nproc-per-node S --max-restarts N``) restarts the whole island, which the other
islands then admit and heal. Where the death shows first depends on where the mates are:
- a SIGKILLed member's sockets close: a mate's collective with it fails at once (gloo: within
  25 ms), in the island's DDP, its sharded optimizer's gathers, or the outer exchange;
- a hung member (SIGSTOP) fails nothing: a collective with it waits for the group's timeout.
Either way the member stops beating, and each mate's ``IslandWatch`` (a thread on the heartbeat
thread's observations) sees it within ``heartbeat_timeout_s``. It then logs which island rank
(and global rank, uuid) stopped beating, marks this process as having left the run (the other
islands need not wait for it when they form their next generation) and ends the process with
exit status ``ISLAND_LOST_EXIT`` (``os._exit``: the training thread may be blocked inside a
collective, where no exception reaches it). An error raised first by the training thread (the
SIGKILL case) is held back for up to a heartbeat timeout so that the message is this one,
naming the dead member, rather than gloo's "Connection reset by peer".

The hung member itself does not survive its island's restart: its launcher sees the mates exit
with an error and stops the whole worker group, SIGTERM then SIGKILL; a stopped process cannot
run a SIGTERM handler, but SIGKILL ends it stopped or not (torchrun's agent sends it after its
grace period). Were it continued before that, it would find itself taken for dead: its mates
are gone, so its own watch ends it the same way.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any

from .membership import Generation
from .run import ElasticRun

logger = logging.getLogger(__name__)

ISLAND_LOST_EXIT = 17  # the exit status of a member whose island lost another member


class IslandLost(RuntimeError):
    """This process's island lost a member: the process must end, and its launcher restart the island."""


class IslandWatch:
    """Ends this process when a member of its island stops beating (an island of one watches nobody)."""

    def __init__(self, run: ElasticRun) -> None:
        self.run = run
        self._lock = threading.Lock()
        self._mates: dict[str, tuple[int, int]] = {}  # uuid -> (island rank, global rank)
        self._generation = -1
        self._stop = threading.Event()
        self._verdict = threading.Event()  # set just before the process is ended
        self._thread = threading.Thread(target=self._run, name="gradsync-island-watch", daemon=True)
        self._previous_hook = sys.excepthook
        if run.island_size > 1:
            sys.excepthook = self._excepthook
            self._thread.start()

    def follow(self, generation: Generation) -> None:
        """Watch this process's island mates in ``generation`` (the heartbeat watches every member)."""
        me = self.run.uuid
        mates = {m: (self._island_rank(generation, m), generation.rank_of(m)) for m in generation.mates(me)}
        with self._lock:
            self._mates, self._generation = mates, generation.number

    def stop(self) -> None:
        """The run ends on purpose: mates leaving now are no loss."""
        self._stop.set()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook

    @staticmethod
    def _island_rank(generation: Generation, uuid: str) -> int:
        ranks = next(r for r in generation.island_ranks() if generation.rank_of(uuid) in r)
        return ranks.index(generation.rank_of(uuid))

    def _run(self) -> None:
        heartbeat = self.run.heartbeat
        while not self._stop.wait(heartbeat.period_s):
            with self._lock:
                mates, number = dict(self._mates), self._generation
            gone = heartbeat.stale() & set(mates)
            if gone:
                gone = {u for u in gone if not self._left(u)}
            if gone and not self._stop.is_set():
                self._end(sorted((mates[u], u) for u in gone), number)

    def _left(self, uuid: str) -> bool:
        try:
            return bool(self.run.store.check([self.run.keys.left(uuid)]))
        except Exception:  # noqa: BLE001 - a store that does not answer says nothing of the mate
            return False

    def _end(self, gone: list[tuple[tuple[int, int], str]], generation: int) -> None:
        run = self.run
        seat = run.seat
        assert seat is not None, "an island member without a seat"
        who = ", ".join(f"island rank {ir} (rank {gr} of generation {generation}, uuid {u})" for (ir, gr), u in gone)
        message = (
            f"gradsync.elastic: island {seat.island!r} lost {who}: it stopped beating for "
            f"{run.heartbeat.timeout_s:g}s (dead or hung). This member (island rank {seat.rank}) exits with status "
            f"{ISLAND_LOST_EXIT} so that its launcher restarts the whole island (torchrun --max-restarts); the "
            "other islands go on and heal it when it is back."
        )
        self._verdict.set()
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        try:
            run.store.set(run.keys.left(run.uuid), "1")  # the other islands need not wait for this process
        except Exception:  # noqa: BLE001 - exiting either way
            pass
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(ISLAND_LOST_EXIT)

    def _excepthook(self, kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> Any:
        """An error that ends the training thread: first give the watch a heartbeat timeout to name a dead mate."""
        if not self._stop.is_set():
            deadline = time.monotonic() + self.run.heartbeat.timeout_s + 3 * self.run.heartbeat.period_s
            while time.monotonic() < deadline and not self._verdict.is_set():
                time.sleep(0.02)
            while self._verdict.is_set():  # the watch is ending the process with its message
                time.sleep(0.1)
        return self._previous_hook(kind, value, trace)
