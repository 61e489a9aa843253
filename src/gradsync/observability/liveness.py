"""When a collective fails: which rank is gone?

[Note: roll call]
A rank killed mid-training makes the others' next collective fail ("connection reset by
peer") or time out, which by itself says nothing about who died. So every process runs
a small responder thread, started with the first DistributedDataParallel, that looks
for a roll-call request in the rendezvous store (MASTER_ADDR:MASTER_PORT, hosted by
torchrun's agent) twice a second. A rank whose collective failed requests one and waits a few
seconds for answers: every live process answers, even one stuck inside a collective,
because its responder thread does not need the main thread. Ranks that do not answer
are named as dead. Until something fails this costs one store connection and two tiny
store queries per second per process; no extra collective. The thread is stopped at
interpreter exit, before the store's C++ client is torn down.

[Note: a store that dies with rank 0]
Launched without torchrun (``mp.spawn``, ``init_method="env://"``), the store lives in rank
0's process. Rank 0 fails too when a peer dies, runs its roll call and may exit before a slower
survivor starts its own: that one then finds no store at all. So every roll call publishes its
verdict in the store, and every responder thread that answered it reads the verdict back and
keeps it; a survivor that cannot reach the store reports the last verdict it saw, which names
the dead rank, instead of blaming rank 0.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

ROLL_CALL_WAIT_S = 3.0
# A live store answers at once; waiting longer for a dead one only delays the error.
_STORE_TIMEOUT = timedelta(seconds=2)
_RESPONDER_TIMEOUT = timedelta(seconds=2)
# The responder looks for a roll call this often: well inside ROLL_CALL_WAIT_S.
_POLL_S = 0.5
_started: set[tuple[str, str]] = set()
# The last roll call's verdict this process saw, kept by its responder thread ([Note: a store
# that dies with rank 0]): {"by": rank, "missing": [ranks], "where": text}.
_last_verdict: dict[str, Any] | None = None


def _prefix() -> str:
    # A restarted job (torchrun --max-restarts) must not see the answers of the previous attempt.
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"gradsync/roll_call/{run}/{attempt}"


def _connect(timeout: timedelta) -> dist.TCPStore | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def start_responder() -> None:
    """Answer roll calls from this process from now on (idempotent, best effort)."""
    key = (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
    if key in _started or not all(key) or not dist.is_initialized():
        return
    _started.add(key)
    stop = threading.Event()
    thread = threading.Thread(
        target=_respond_until, args=(dist.get_rank(), stop), name="gradsync-roll-call", daemon=True
    )
    thread.start()

    # The thread must be out of the store's C++ code before the interpreter shuts down:
    # a daemon thread unwound inside a C++ call aborts the process (SIGABRT at exit).
    def _stop() -> None:
        stop.set()
        thread.join(timeout=2 * _POLL_S + _RESPONDER_TIMEOUT.total_seconds())

    atexit.register(_stop)


def _respond_until(rank: int, stop: threading.Event) -> None:
    try:
        store = _connect(_RESPONDER_TIMEOUT)
        if store is None:
            return
        prefix = _prefix()
        generation = 1
        awaited: list[int] = []  # roll calls answered whose verdict is still to come
        while not stop.wait(_POLL_S):
            request = f"{prefix}/request/{generation}"
            while store.check([request]) and not stop.is_set():
                store.set(f"{prefix}/answer/{generation}/{rank}", store.get(request))  # type: ignore[arg-type]  # bytes
                awaited.append(generation)
                generation += 1
                request = f"{prefix}/request/{generation}"
            awaited = [g for g in awaited if not _keep_verdict(store, prefix, g, rank)]
    except Exception:  # noqa: BLE001 - the store went away (job over, or its host died)
        return


def _keep_verdict(store: dist.TCPStore, prefix: str, generation: int, rank: int) -> bool:
    global _last_verdict
    key = f"{prefix}/verdict/{generation}"
    if not store.check([key]):
        return False
    _last_verdict = json.loads(store.get(key).decode())
    store.set(f"{prefix}/kept/{generation}/{rank}", "1")  # the roll caller may now go (and exit)
    return True


def roll_call(where: str, wait_s: float = ROLL_CALL_WAIT_S) -> str:
    """A sentence naming the ranks whose processes no longer answer; never raises."""
    if not dist.is_initialized():
        return ""
    world = dist.get_world_size()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    try:
        store = _connect(_STORE_TIMEOUT)
        if store is None:
            return "(Launch with torchrun or init_method='env://' to have the dead rank named.)"
        prefix = _prefix()
        generation = store.add(f"{prefix}/generation", 1)
        store.set(f"{prefix}/request/{generation}", where)
        deadline = time.time() + wait_s
        answered: set[int] = set()
        while len(answered) < world and time.time() < deadline:
            answered |= {r for r in range(world) if store.check([f"{prefix}/answer/{generation}/{r}"])}
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the report must not hide the original failure
        return _without_store(host, port)
    missing = [r for r in range(world) if r not in answered]
    try:  # for survivors that come later and may find the store gone ([Note: a store that dies with rank 0])
        verdict = {"by": dist.get_rank(), "missing": missing, "where": where}
        store.set(f"{prefix}/verdict/{generation}", json.dumps(verdict))
        # If this process hosts the store, it may exit right after raising: give the survivors'
        # responders (one poll) the time to keep the verdict first.
        others = [r for r in answered if r != dist.get_rank()]
        deadline = time.time() + 2 * _POLL_S + 0.5
        while others and time.time() < deadline:
            others = [r for r in others if not store.check([f"{prefix}/kept/{generation}/{r}"])]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - best effort
        pass
    if not missing:
        return "Every rank's process is still alive, so none died: a collective timed out or the ranks desynchronised."
    return f"Rank(s) {missing} did not answer a roll call within {wait_s:.0f}s: their processes have died."


def _without_store(host: str | None, port: str | None) -> str:
    """What a survivor can say when the rendezvous store is gone."""
    gone = (
        f"The rendezvous store at {host}:{port} no longer answers: outside torchrun it lives in rank 0's "
        "process, which has exited (after its own error) or died."
    )
    verdict = _last_verdict
    if verdict is not None and verdict.get("missing"):
        return (
            f"{gone} Rank {verdict['by']}'s roll call during {verdict['where']} found that rank(s) "
            f"{verdict['missing']} did not answer: their processes have died. Launch with torchrun for a "
            "store that outlives every rank."
        )
    return f"{gone} Launch with torchrun for a store that outlives every rank, so the dead rank can be named."
