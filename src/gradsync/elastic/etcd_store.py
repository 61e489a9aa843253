"""``EtcdStore``: a ``torch.distributed.Store`` over a replicated etcd cluster (etcd's v3 JSON gateway).

[Note: a store that survives losing a machine]
The TCPStore of a fault-tolerant run is one process: losing its machine loses the run. etcd keeps
every key on each of its members (3 or 5) and answers while a majority of them (the quorum: 2 of 3,
3 of 5) is up and has elected a leader. Every write is a Raft entry the quorum has stored before
etcd answers, so what one trainer read is what every other will read, whichever member each
talks to. ``EtcdStore`` speaks to it through the v3 API's JSON gateway (``/v3/kv/put``,
``range``, ``txn``, ``deleterange``) with the standard library's ``http.client``:

- ``set``/``get``/``check``/``delete_key``/``num_keys``: a put, a range, one read-only
  transaction, a deleterange, a counted range. ``get`` and ``wait`` poll until the key exists or
  the store's ``timeout`` passes, then raise ``DistStoreError`` as TCPStore does.
- ``compare_set``: one transaction (the key is absent / holds ``expected`` -> put, else read it
  back), with TCPStore's answers in all five cases.
- ``add``: a transaction on the counter's ``mod_revision`` (one round trip when this client wrote
  it last, as for a heartbeat; a retry on a conflict). It also writes a mark of this client and
  thread, so that a request whose answer was lost (the member died) and that is sent again is
  never counted twice.

Fail-over: the client is given every member's endpoint. A request goes to the member that answered
last, with a timeout of its own (``request_timeout_s``, 0.5 s) far shorter than the store's; a
member that refuses, errs or does not answer in time is left for the next one, round after round,
until the store's timeout. A request sent to a follower while the leader dies is therefore sent
again after 0.5 s instead of waiting for the whole timeout. When the timeout passes with no
answer, ``EtcdUnavailable`` (a ``DistStoreError``) says how many members answered and whether any
of them has a leader.

Keys live under ``<namespace>/k/`` in etcd (``etcd://h1:2379,h2:2379/namespace``; "gradsync" by
default), the add marks under ``<namespace>/adds/``.

Why no client library: etcd3gw (the maintained v3-gateway client) builds on ``requests``, which
measured 0.6-0.9 ms more per request than ``http.client`` here (put 2.3 vs 1.4 ms, range 1.35 vs
0.7 ms, compare-and-swap 2.6 vs 1.5 ms: a store round trip is on every step's critical path),
talks to one endpoint per client (the fail-over above would be ours anyway), needs Python >= 3.10
and brings seven packages. The gRPC clients (etcd3) are unmaintained since 2020.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import itertools
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

DEFAULT_REQUEST_TIMEOUT_S = 0.5
_TXN_MAX_OPS = 128  # etcd's default --max-txn-ops
_RETRIED_CODES = {2, 4, 8, 10, 14}  # gRPC UNKNOWN (dropped proposal), DEADLINE, EXHAUSTED, ABORTED, UNAVAILABLE
# A member's status, asked in parallel when saying why nothing answered. A probe that times out is
# asked once more: a lone member on a loaded machine has been seen to miss one 2 s probe (a full
# suite on 2 cores) and then be counted as gone; a refused connection is final.
_PROBE_TIMEOUT_S = 1.5
_PROBE_TRIES = 2
_marks = itertools.count(1)
# Every EtcdStore ever made, kept alive: torch's C++ side (a PrefixStore, a gloo group) holds the
# C++ half of a Python store but not the Python object, whose methods it calls; were the object
# collected, its next call would fail with "INTERNAL ASSERT FAILED ... Not implemented". A process
# makes a handful (the run's clients, the heartbeat's).
_keep_alive: list[EtcdStore] = []


class EtcdUnavailable(dist.DistStoreError):
    """No etcd member answered within the store's timeout (the cluster lost its quorum, or is unreachable)."""


class _Unanswered(Exception):
    """One request to one member failed in a way another member (or a later try) may not."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out  # no answer in time, as opposed to refused or failed outright


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def parse_address(address: str) -> tuple[list[str], str]:
    """``etcd://h1:2379,h2:2379[/namespace]`` -> (endpoints, namespace)."""
    rest = address[len("etcd://") :]
    hosts, _, namespace = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"etcd endpoint {endpoint!r} in {address!r} is not host:port (e.g. 'etcd://h1:2379,h2:2379')."
            )
    if not endpoints:
        raise ValueError(f"{address!r} names no etcd endpoint: write etcd://h1:2379,h2:2379,h3:2379.")
    return endpoints, namespace.strip("/") or "gradsync"


class EtcdStore(dist.Store):
    """A store whose keys are replicated by the etcd cluster at ``endpoints`` ([Note: a store that survives
    losing a machine]). ``timeout`` bounds ``get``/``wait`` and how long an unavailable cluster is waited for."""

    timeout: timedelta  # dist.Store's property (set by set_timeout), which torch's type stubs leave out

    def __init__(
        self,
        endpoints: list[str],
        timeout: timedelta = timedelta(seconds=300),
        namespace: str = "gradsync",
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self.endpoints = list(endpoints)
        self.namespace = namespace
        self.request_timeout_s = request_timeout_s
        self.set_timeout(timeout)
        self._root = f"{namespace}/k/"
        self._client = f"{namespace}/adds/{uuid.uuid4().hex}"
        self._preferred = 0  # the endpoint that answered last
        self._local = threading.local()  # one connection per endpoint and thread
        self._lock = threading.Lock()
        self._counters: dict[str, tuple[int, int]] = {}  # key -> (value, mod_revision) this client saw last
        _keep_alive.append(self)

    @classmethod
    def from_address(cls, address: str, timeout: timedelta) -> EtcdStore:
        endpoints, namespace = parse_address(address)
        return cls(endpoints, timeout, namespace)

    def clone(self) -> EtcdStore:
        return EtcdStore(self.endpoints, self.timeout, self.namespace, self.request_timeout_s)

    # ------------------------------------------------------------------ the Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self._call("/v3/kv/put", {"key": self._key(key), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        deadline = self._deadline()
        found: bytes | None = self._wait_for(lambda: self._range(key), deadline)
        if found is None:
            raise dist.DistStoreError(f"wait timeout after {self._timeout_ms()}ms, keys: {key}")
        return found

    def check(self, keys: list[str]) -> bool:
        for start in range(0, len(keys), _TXN_MAX_OPS):
            ops = [
                {"request_range": {"key": self._key(k), "count_only": True}} for k in keys[start : start + _TXN_MAX_OPS]
            ]
            reply = self._call("/v3/kv/txn", {"success": ops})
            if any(int(r["response_range"].get("count", 0)) == 0 for r in reply.get("responses", [])):
                return False
        return True

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = timeout if timeout is not None else self.timeout
        deadline = time.monotonic() + timeout.total_seconds()
        if self._wait_for(lambda: True if self.check(keys) else None, deadline) is None:
            raise dist.DistStoreError(f"wait timeout after {int(timeout.total_seconds() * 1000)}ms, keys: {keys}")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore's semantics: absent and ``expected`` empty, or present and equal to ``expected``:
        set ``desired`` and return it; absent otherwise: return ``expected``; else the current value."""
        expected, desired = _bytes(expected), _bytes(desired)
        target = self._key(key)
        if expected:
            compare = {"key": target, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        else:
            compare = {"key": target, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        reply = self._call(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": target, "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": target}}],
            },
        )
        if reply.get("succeeded"):
            return desired
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else expected

    def add(self, key: str, amount: int) -> int:
        if amount == 0:
            current = self._read_counter(key)
            if current is not None:
                return current
        target = self._key(key)
        mark_key, mark = self._mark()
        put_mark = {"request_put": {"key": mark_key, "value": _b64(mark)}}
        while True:
            with self._lock:
                value, revision = self._counters.get(key, (0, 0))
            new = value + amount
            reply = self._call(
                "/v3/kv/txn",
                {
                    "compare": [{"key": target, "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}],
                    "success": [{"request_put": {"key": target, "value": _b64(str(new))}}, put_mark],
                    "failure": [{"request_range": {"key": target}}, {"request_range": {"key": mark_key}}],
                },
            )
            if reply.get("succeeded"):
                with self._lock:
                    self._counters[key] = (new, int(reply["header"]["revision"]))
                return new
            counter, mine = (r["response_range"].get("kvs", []) for r in reply["responses"])
            if mine and _unb64(mine[0]["value"]) == mark:  # an earlier send of this very request was applied
                return new
            with self._lock:
                self._counters[key] = (
                    (int(_unb64(counter[0]["value"])), int(counter[0]["mod_revision"])) if counter else (0, 0)
                )

    def beat(self, key: str, value: str, reads: list[str]) -> list[bytes | None]:
        """Put ``key`` and read ``reads`` (None: absent) in one transaction: a heartbeat round
        (elastic/heartbeat.py) in one request instead of one per key."""
        puts = [{"request_put": {"key": self._key(key), "value": _b64(value)}}]
        found: list[bytes | None] = []
        for start in range(0, max(len(reads), 1), _TXN_MAX_OPS - 1):
            ranges = [{"request_range": {"key": self._key(k)}} for k in reads[start : start + _TXN_MAX_OPS - 1]]
            reply = self._call("/v3/kv/txn", {"compare": [], "success": puts + ranges})
            for response in reply.get("responses", [])[len(puts) :]:
                kvs = response.get("response_range", {}).get("kvs", [])
                found.append(_unb64(kvs[0]["value"]) if kvs else None)
            puts = []
        return found

    def delete_key(self, key: str) -> bool:
        reply = self._call("/v3/kv/deleterange", {"key": self._key(key)})
        with self._lock:
            self._counters.pop(key, None)
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        end = self._root[:-1] + chr(ord(self._root[-1]) + 1)
        reply = self._call("/v3/kv/range", {"key": _b64(self._root), "range_end": _b64(end), "count_only": True})
        return int(reply.get("count", 0))

    # torch's C++ trampoline looks these two up by their C++ names (PrefixStore calls them).
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815

    # ------------------------------------------------------------------ helpers
    def _key(self, key: str) -> str:
        return _b64(self._root + key)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout.total_seconds()

    def _timeout_ms(self) -> int:
        return int(self.timeout.total_seconds() * 1000)

    def _mark(self) -> tuple[str, bytes]:
        return _b64(f"{self._client}/{threading.get_ident()}"), str(next(_marks)).encode()

    def _range(self, key: str, deadline: float | None = None) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": self._key(key)}, deadline).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def _read_counter(self, key: str) -> int | None:
        kvs = self._call("/v3/kv/range", {"key": self._key(key)}).get("kvs", [])
        if not kvs:
            return None
        value, revision = int(_unb64(kvs[0].get("value", ""))), int(kvs[0]["mod_revision"])
        with self._lock:
            self._counters[key] = (value, revision)
        return value

    def _wait_for(self, probe: Any, deadline: float) -> Any:
        """``probe()`` until it returns something other than None, or ``deadline``: 0.25 ms apart for
        20 ms (a commit decision is usually there within a few), 1 ms until 0.1 s, then up to 20 ms."""
        started = time.monotonic()
        while True:
            found = probe()
            if found is not None:
                return found
            now = time.monotonic()
            if now >= deadline:
                return None
            elapsed = now - started
            pause = 0.00025 if elapsed < 0.02 else 0.001 if elapsed < 0.1 else min(0.02, elapsed / 10)
            time.sleep(min(pause, max(0.0, deadline - now)))

    # ------------------------------------------------------------------ requests and fail-over
    def _call(self, path: str, body: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """POST ``body`` to ``path``, moving to the next member on any failure, until ``deadline``."""
        deadline = deadline if deadline is not None else self._deadline()
        payload = json.dumps(body).encode()
        failures: dict[str, str] = {}
        for attempt in itertools.count(1):
            index = self._preferred
            endpoint = self.endpoints[index]
            budget = min(self.request_timeout_s, max(0.05, deadline - time.monotonic()))
            try:
                return self._post(endpoint, path, payload, budget)
            except _Unanswered as error:
                failures[endpoint] = str(error)
                self._preferred = (index + 1) % len(self.endpoints)
            if time.monotonic() >= deadline:
                raise EtcdUnavailable(self._describe(failures, path))
            if attempt % len(self.endpoints) == 0:  # a full round failed: an election, probably
                time.sleep(min(0.02 * attempt / len(self.endpoints), 0.1, max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def _post(self, endpoint: str, path: str, payload: bytes, timeout_s: float) -> dict[str, Any]:
        connections = self._local.__dict__.setdefault("connections", {})
        connection = connections.get(endpoint)
        if connection is None:
            host, _, port = endpoint.rpartition(":")
            connection = connections[endpoint] = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        try:
            connection.request("POST", path, payload, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            data = reply.read()
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            raise _Unanswered(message, timed_out=isinstance(error, TimeoutError)) from None
        answer = json.loads(data) if data else {}
        if reply.status == 200:
            return answer
        code = answer.get("code")
        message = answer.get("message") or answer.get("error") or data.decode(errors="replace")
        if code in _RETRIED_CODES or reply.status >= 500 and code is None:
            raise _Unanswered(message)
        raise RuntimeError(f"etcd at {endpoint} refused {path}: {message} (code {code})")

    def _status(self, endpoint: str) -> dict[str, Any] | str:
        """A member's status, or why there is none: ``"refused"`` (or another error: its machine or
        process is gone) or ``"slow"`` (every try timed out: alive, perhaps, but too loaded to tell).
        Asked from a pool thread: a connection of its own, not the one a failed request left behind.
        Asked again only after a timeout (see _PROBE_TRIES)."""
        for _ in range(_PROBE_TRIES):
            try:
                return self._post(endpoint, "/v3/maintenance/status", b"{}", _PROBE_TIMEOUT_S)
            except _Unanswered as error:
                if not error.timed_out:
                    return "refused"
            except (RuntimeError, ValueError):
                return "refused"
        return "slow"

    @staticmethod
    def _slow_note(slow: list[str]) -> str:
        """Members that neither answered nor refused: a loaded machine's, or a hung process."""
        if not slow:
            return ""
        return f"; no status from {', '.join(slow)} within {_PROBE_TRIES} x {_PROBE_TIMEOUT_S}s: alive but too slow?"

    def _describe(self, failures: dict[str, str], path: str) -> str:
        """Why nothing answered: which members answer their status at all, and whether one leads."""
        with concurrent.futures.ThreadPoolExecutor(len(self.endpoints)) as pool:
            statuses = list(pool.map(self._status, self.endpoints))
        answered = [endpoint for endpoint, status in zip(self.endpoints, statuses) if isinstance(status, dict)]
        slow = [endpoint for endpoint, status in zip(self.endpoints, statuses) if status == "slow"]
        leaders = {s["leader"] for s in statuses if isinstance(s, dict) and s.get("leader") not in (None, "0")}
        size, quorum = len(self.endpoints), len(self.endpoints) // 2 + 1
        if not leaders:
            verdict = f"none has a leader: the cluster lost its quorum ({quorum} of {size} members are needed)"
        else:
            verdict = "one of them reports a leader, yet requests failed"
        errors = "; ".join(f"{e}: {m}" for e, m in failures.items())
        return (
            f"etcd store unavailable for {self.timeout.total_seconds():.1f}s ({path}): {len(answered)} of {size} "
            f"members answered ({', '.join(answered) or 'none'}{self._slow_note(slow)}), {verdict}. "
            f"Last errors: {errors}"
        )
