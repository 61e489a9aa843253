"""One store protocol, two backends: every test runs on TCPStore (the reference) and on EtcdStore.

What gradsync's fault-tolerant mode and gloo's rendezvous use of a ``torch.distributed.Store``:
``compare_set`` in its five cases, ``add`` under racing clients, ``get``/``wait`` that block and
time out with torch's exception type, ``check``, ``delete_key``, ``num_keys``, the timeout, the
same through a ``PrefixStore``, and a gloo group rendezvoused through it. The etcd tests use a
3-member cluster on loopback (tests/etcd_support.py) and skip with the reason where etcd cannot
be had.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync.elastic import tcp_store
from gradsync.elastic.backends import connect
from gradsync.elastic.etcd_store import EtcdStore, _Unanswered

from etcd_support import etcd_cluster  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", "etcd"])
def client(request: pytest.FixtureRequest):
    """``client(timeout_s)``: a new client of one fresh store (a new TCPStore, or a new etcd namespace)."""
    if request.param == "tcp":
        server = tcp_store.serve("127.0.0.1", 0)
        yield lambda timeout_s=5.0: tcp_store.connect(f"127.0.0.1:{server.port}", timedelta(seconds=timeout_s))
        del server
    else:
        cluster = request.getfixturevalue("etcd_cluster")
        address = f"{cluster.address}/{uuid.uuid4().hex[:8]}"
        yield lambda timeout_s=5.0: connect(address, timedelta(seconds=timeout_s))


def test_compare_set_answers_as_tcpstore_does_in_all_five_cases(client) -> None:
    store = client()
    assert store.compare_set("absent-empty", "", "new") == b"new"  # absent, expected "": set
    assert store.get("absent-empty") == b"new"
    assert store.compare_set("absent-other", "old", "new") == b"old"  # absent, expected other: no set
    assert not store.check(["absent-other"])
    store.set("match", "old")
    assert store.compare_set("match", "old", "new") == b"new"  # present and equal: set
    assert store.get("match") == b"new"
    store.set("mismatch", "current")
    assert store.compare_set("mismatch", "old", "new") == b"current"  # present, other: the current value
    assert store.get("mismatch") == b"current"
    store.set("present", "current")
    assert store.compare_set("present", "", "new") == b"current"  # present, expected "": first writer wins
    assert store.get("present") == b"current"


def test_add_under_three_racing_clients_counts_every_increment_once(client) -> None:
    clients, per_client = [client() for _ in range(3)], 60
    seen: list[list[int]] = [[] for _ in clients]

    def count(index: int) -> None:
        for _ in range(per_client):
            seen[index].append(clients[index].add("counter", 1))

    threads = [threading.Thread(target=count, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    every = sorted(v for values in seen for v in values)
    assert every == list(range(1, 3 * per_client + 1))  # each add returned a value of its own
    assert clients[0].add("counter", 0) == 3 * per_client
    assert clients[1].get("counter") == str(3 * per_client).encode()  # a counter reads as its decimal string
    assert clients[2].add("counter", -5) == 3 * per_client - 5
    assert clients[0].add("fresh", 0) == 0 and clients[0].check(["fresh"])  # add(key, 0) creates it, as TCPStore


def test_get_blocks_until_another_client_sets_the_key(client) -> None:
    reader, writer = client(), client()
    timer = threading.Timer(0.3, lambda: writer.set("later", b"\x00bytes\xff"))
    timer.start()
    started = time.monotonic()
    assert reader.get("later") == b"\x00bytes\xff"
    assert 0.25 < time.monotonic() - started < 3
    reader.wait(["later"])
    timer.join()


def test_get_and_wait_time_out_with_torchs_exception_type(client) -> None:
    store = client(timeout_s=0.6)
    assert store.timeout == timedelta(seconds=0.6)
    for name, call in [("get", lambda: store.get("never")), ("wait", lambda: store.wait(["never"]))]:
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            call()
        assert 0.5 < time.monotonic() - started < 3, name
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=0.2))
    assert time.monotonic() - started < 1.5
    store.set_timeout(timedelta(seconds=0.2))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    assert time.monotonic() - started < 1.5


def test_check_delete_key_and_num_keys(client) -> None:
    store = client()
    before = store.num_keys()
    store.set("a", "1")
    store.set("b", "2")
    assert store.num_keys() == before + 2
    assert store.check(["a", "b"]) and not store.check(["a", "missing"]) and store.check([])
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"]) and store.check(["b"])
    assert store.num_keys() == before + 1
    store.set("a", "again")  # a deleted key can be set again
    assert store.get("a") == b"again"
    assert store.add("counted", 2) == 2 and store.delete_key("counted") and store.add("counted", 1) == 1


def test_everything_works_through_a_prefix_store(client) -> None:
    base = client()
    store = dist.PrefixStore("job/7", base)
    store.set("k", "v")
    assert store.get("k") == b"v" and base.get("job/7/k") == b"v"
    assert store.add("n", 3) == 3 and base.add("job/7/n", 0) == 3
    assert store.compare_set("cas", "", "first") == b"first" and store.compare_set("cas", "", "second") == b"first"
    assert store.check(["k", "n"]) and not store.check(["other"])
    assert store.delete_key("k") and not base.check(["job/7/k"])
    assert store.num_keys() >= 2
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        store.get("missing")
    nested = dist.PrefixStore("inner", store)
    nested.set("deep", "1")
    assert base.get("job/7/inner/deep") == b"1"


def test_a_gloo_group_rendezvouses_through_the_store(client, request: pytest.FixtureRequest) -> None:
    store = client()
    address = f"127.0.0.1:{store.port}" if isinstance(store, dist.TCPStore) else _etcd_address(store)
    script = Path(__file__).parent / "jobs" / "store_group.py"
    world = 2
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), address, "pg/0", str(rank), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=45)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["sum"] for r in results] == [3.0] * world
    assert {r["broadcast"] for r in results} == {"from rank 0"}


def _etcd_address(store: EtcdStore) -> str:
    return f"etcd://{','.join(store.endpoints)}/{store.namespace}"


# ---------------------------------------------------------------------- etcd only


def test_an_add_whose_answer_was_lost_is_counted_once(etcd_cluster) -> None:  # noqa: F811
    """A member that applied a request may die before it answers; the client sends it again elsewhere."""
    store = connect(f"{etcd_cluster.address}/{uuid.uuid4().hex[:8]}", timedelta(seconds=5))
    assert store.add("n", 1) == 1
    real = store._post
    lost = {"left": 1}

    def answer_lost(endpoint: str, path: str, payload: bytes, timeout_s: float) -> dict:
        reply = real(endpoint, path, payload, timeout_s)
        if path == "/v3/kv/txn" and lost["left"]:
            lost["left"] -= 1
            raise _Unanswered("connection reset (injected after the request was applied)")
        return reply

    store._post = answer_lost
    assert store.add("n", 1) == 2
    assert lost["left"] == 0
    store._post = real
    assert store.add("n", 0) == 2


def test_a_dead_endpoint_in_the_list_is_skipped(etcd_cluster) -> None:  # noqa: F811
    dead = "127.0.0.1:1"  # nothing listens there: connection refused
    address = f"etcd://{dead},{','.join(m.endpoint for m in etcd_cluster.members)}/{uuid.uuid4().hex[:8]}"
    store = connect(address, timedelta(seconds=5))
    started = time.monotonic()
    store.set("k", "v")
    assert store.get("k") == b"v" and time.monotonic() - started < 1


def test_addresses_are_checked() -> None:
    with pytest.raises(ValueError, match="is not host:port"):
        connect("etcd://h1:2379,nohost", timedelta(seconds=1))
    with pytest.raises(ValueError, match="names no etcd endpoint"):
        connect("etcd://", timedelta(seconds=1))
    with pytest.raises(ValueError, match="is not host:port"):
        connect("nohost", timedelta(seconds=1))
