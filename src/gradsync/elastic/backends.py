"""The run's store, by address: ``host:port`` is a TCPStore, ``etcd://h1:2379,h2:2379,...`` an etcd cluster.

Everything above the store (membership, the commit, heartbeats, the heal, gloo's rendezvous)
speaks ``torch.distributed.Store`` and does not know which one it got.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from . import tcp_store
from .etcd_store import EtcdStore

ETCD_SCHEME = "etcd://"


def connect(address: str, timeout: timedelta) -> dist.Store:
    """A client of the store at ``address`` (TCPStore's ``host:port``, or ``etcd://`` and the members)."""
    if address.startswith(ETCD_SCHEME):
        return EtcdStore.from_address(address, timeout)
    return tcp_store.connect(address, timeout)
