"""Islands in a fault-tolerant run: processes that train one replica together, in or out as a whole.

[Note: membership by island]
An *island* is a few processes (a node's GPUs, a site's) that train one replica together over a
fast link: a DDP (or a sharded optimizer) every step among them, DiLoCo across islands. Its
members cannot go on without one of them: their process group, their buckets and (with a sharded
optimizer) their state are laid out over exactly them. So membership is decided per island:
- every process says at arrival which island it is in and its rank there (its *seat*: the
  island's name, rank and size; ``GRADSYNC_ISLAND`` with torchrun's ``RANK``/``WORLD_SIZE``);
- a generation keeps an island only if every one of its members is present; a present member
  whose island is not whole is left out with it (its mates then exit: [Note: an island member's
  death, seen by its mates] in island_watch.py), and the launcher restarts the whole island;
- a restarted island is admitted only once all its members have arrived, as one joiner;
- ``replicas`` and ``min_replicas`` count islands.
A plain replica is an island of one, named by its uuid: every rule above is then the old
per-process one, and nothing of it costs a store request that the plain run did not make,
beside one key per arrival.

Within a generation the members are listed island by island, each island's in its rank order
(founders by the order their islands became whole, joiners as admitted), so an island's global
ranks are contiguous and its first member is its rank 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch.distributed as dist

from .keys import Keys


@dataclass(frozen=True)
class Seat:
    """Where one process trains: island ``island``'s member ``rank`` of ``size``."""

    island: str
    rank: int
    size: int


def seat_for(uuid: str, island: str | None, rank: int | None, size: int | None) -> Seat:
    """This process's seat from ``elastic.init``'s arguments, else the environment; a plain replica's
    is an island of one named by its uuid."""
    name = island if island is not None else os.environ.get("GRADSYNC_ISLAND")
    if not name:
        if rank not in (None, 0) or size not in (None, 1):
            raise ValueError(
                f"island_rank={rank} / island_size={size} without an island name: pass island='name' (or set "
                "GRADSYNC_ISLAND) for a process that trains one replica together with others."
            )
        return Seat(uuid, 0, 1)
    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    size = size if size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < size:
        raise ValueError(
            f"island {name!r}: rank {rank} is not in 0..{size - 1} (island_size={size}). Launch each island with "
            "its own torchrun (RANK and WORLD_SIZE are the island's), or pass island_rank and island_size."
        )
    return Seat(name, rank, size)


def announce(store: dist.Store, keys: Keys, uuid: str, seat: Seat) -> None:
    """Written before the process arrives, so that whoever reads its arrival can read its seat."""
    store.set(keys.seat(uuid), json.dumps(asdict(seat)))


def seat_of(store: dist.Store, keys: Keys, uuid: str) -> Seat:
    return Seat(**json.loads(store.get(keys.seat(uuid))))


def reader(store: dist.Store, keys: Keys) -> Callable[[str], Seat]:
    """Each process's seat, read from the store once (a seat never changes)."""
    known: dict[str, Seat] = {}

    def seat(uuid: str) -> Seat:
        if uuid not in known:
            known[uuid] = seat_of(store, keys, uuid)
        return known[uuid]

    return seat


def whole(uuids: Sequence[str], seats: Callable[[str], Seat]) -> list[str]:
    """Those of ``uuids`` whose island is whole among them (each of its ranks there), in order."""
    held: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for uuid in uuids:
        seat = seats(uuid)
        held.setdefault(seat.island, set()).add(seat.rank)
        size[seat.island] = seat.size
    complete = {name for name, ranks in held.items() if ranks == set(range(size[name]))}
    return [u for u in uuids if seats(u).island in complete]


def in_island_order(uuids: Sequence[str], seats: Callable[[str], Seat]) -> list[str]:
    """``uuids`` grouped island by island (islands in order of first appearance), each in rank order."""
    order: list[str] = []
    for uuid in uuids:
        if seats(uuid).island not in order:
            order.append(seats(uuid).island)
    return sorted(uuids, key=lambda u: (order.index(seats(u).island), seats(u).rank))


def complete_arrivals(
    arrivals: Sequence[tuple[int, str]], seats: Callable[[str], Seat], skip: set[str], wanted: int | None = None
) -> tuple[list[str], int]:
    """The islands made whole by ``arrivals`` ((index, uuid) in index order), and how far they are handled.

    For each island seat the latest arrival counts (an earlier one is a previous incarnation of a
    restarted island, or a member that died before it was admitted). Islands count in the order they
    became whole; at most ``wanted`` of them. Returns their members (island by island, in rank order)
    and the last index before the first arrival still waiting for its island (every arrival up to it
    is a member now, or superseded); ``skip``: uuids already members.
    """
    latest: dict[tuple[str, int], tuple[int, str]] = {}
    done: list[str] = []  # islands, in the order they became whole
    scanned = 0
    for index, uuid in arrivals:
        scanned = index
        if uuid in skip:
            continue
        seat = seats(uuid)
        latest[(seat.island, seat.rank)] = (index, uuid)
        if seat.island not in done and all((seat.island, r) in latest for r in range(seat.size)):
            done.append(seat.island)
            if wanted is not None and len(done) == wanted:
                break
    members = [latest[(name, r)][1] for name in done for r in range(seats(latest[(name, 0)][1]).size)]
    waiting = [index for (name, _), (index, _) in latest.items() if name not in done]
    handled = (min(waiting) - 1) if waiting else scanned
    return members, handled
