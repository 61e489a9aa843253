"""Multi-process test harness: ``run_distributed(fn, world_size)``.

Workers are started once per world size (gloo, localhost, one thread each) and reused
across tests, because importing torch in a fresh process costs seconds. ``fn`` must be
a module-level function; it runs on every rank with the default process group ready
and its per-rank return values come back as a list.

A rank that raises makes ``run_distributed`` raise with that rank's traceback. A rank
that does not answer within ``timeout_s`` (a hang) gets the whole pool killed and
restarted, and the test fails naming the silent ranks.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours (see _close_pools)
import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

# A collective that cannot complete fails after this long instead of blocking the suite.
PROCESS_GROUP_TIMEOUT_S = 60
# After one rank failed, how long the others get to finish before the pool is killed.
GRACE_AFTER_FAILURE_S = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn: Any, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the test
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int, pg_timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
        self.world_size = world_size
        context = mp.get_context("spawn")
        port = _free_port()
        self.connections = []
        self.processes = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker_main, args=(rank, world_size, port, child, pg_timeout_s), daemon=False
            )
            process.start()
            self.connections.append(parent)
            self.processes.append(process)

    def run(
        self, fn: Callable[..., Any], args: tuple, timeout_s: float, expect_dead: frozenset[int] = frozenset()
    ) -> list[Any]:
        for conn in self.connections:
            conn.send((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < self.world_size:
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
            waiting = [r for r in range(self.world_size) if r not in results and r not in errors]
            if time.monotonic() > deadline:
                self.kill()
                if errors:
                    break
                raise TimeoutError(
                    f"{fn.__name__}: ranks {waiting} of {self.world_size} did not finish within {timeout_s}s "
                    "(a hang); the worker pool was restarted"
                )
            for rank in waiting:
                conn = self.connections[rank]
                if conn.poll(0.01):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        if rank in expect_dead:
                            results[rank] = None  # the test killed this rank on purpose
                        else:
                            errors[rank] = "worker process died"
                        continue
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{report}")
        return [results[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join(timeout=5)
        if _pools.get(self.world_size) is self:
            del _pools[self.world_size]

    def close(self) -> None:
        for conn in self.connections:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


_pools: dict[int, WorkerPool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout_s: float = 120,
    isolated: bool = False,
    expect_dead: frozenset[int] = frozenset(),
    pg_timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank of a ``world_size`` gloo group; per-rank results.

    ``isolated=True`` runs in fresh workers that are discarded afterwards: for tests that
    leave collectives unmatched on purpose. Ranks in ``expect_dead`` may kill themselves
    (their result is ``None``); ``pg_timeout_s`` sets an isolated group's collective timeout.
    """
    if isolated or expect_dead:
        pool = WorkerPool(world_size, pg_timeout_s)
        try:
            return pool.run(fn, args, timeout_s, expect_dead)
        finally:
            pool.close()
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = WorkerPool(world_size)
    return pool.run(fn, args, timeout_s)


# atexit runs handlers last-registered-first: ours must stop the workers before
# multiprocessing's own handler joins them, or interpreter exit would wait forever.
@atexit.register
def _close_pools() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
