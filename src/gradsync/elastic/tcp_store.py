"""The rendezvous store of a fault-tolerant run: one TCPStore that outlives every trainer.

``python -m gradsync.elastic.store`` (store.py) hosts it; this module is what the package imports,
so that running that entry point does not find it imported already.

[Note: a store outside the trainers]
Plain DDP's store lives in torchrun's agent, or in rank 0's process: it dies with the job, or
with rank 0. A fault-tolerant run has one replica per launcher (each restarted alone), so the
store that ties them together must belong to none of them. ``python -m gradsync.elastic.store
--port 29400`` hosts it; every replica is given its address. Losing the store loses the run,
as losing torchft's lighthouse does.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

DEFAULT_PORT = 29400


def connect(address: str, timeout: timedelta) -> dist.TCPStore:
    """A client of the store at ``host:port``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address {address!r} is not host:port (e.g. 'localhost:{DEFAULT_PORT}').")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def serve(host: str = "0.0.0.0", port: int = DEFAULT_PORT) -> dist.TCPStore:
    """Host the store in this process (it serves from a C++ thread until the object is dropped)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
