"""Who exchanges with whom: replicas, or islands of a gradsync DDP each.

[Note: islands]
With a plain module every process is a replica and the outer exchange runs over ``group`` (all
processes by default). With a gradsync ``DistributedDataParallel`` the DDP's process group is one
*island*: its ``S`` members train one replica together over a fast link and hold the same
parameters bit for bit. Across islands the link is slow, so no member sends the whole outer
gradient: member ``s`` of every island forms a *counterpart group* with member ``s`` of every other
island, and each counterpart group exchanges slice ``s`` of the outer gradient (1/S of it). The
island then all-gathers the ``S`` averaged slices over its fast link, so every member ends with
the whole average, and applies the same outer step.

Islands may differ in size. The outer gradient is then cut into as many slices as the *smallest*
island has members: member ``s`` of every island, for ``s`` below that size, forms counterpart
group ``s`` and exchanges slice ``s``; a larger island's other members have no counterparts and
send nothing across, and receive the averaged slices from their island mates in the island
all-gather (their share of the slow link is zero; the smallest island's members carry one slice
each, as with equal islands of that size). Every island is one replica of the average, whatever
its size, as DiLoCo's replicas are; its members train on more rows per step together, which is
the island's own business (its DDP averages over them).

[Note: groups of our own]
With ``delay > 0`` the exchange runs on a thread of its own while the training loop goes on, and
the loop's own collectives (the island DDP's all-reduces, a user's ``all_reduce`` of the loss)
must not interleave with it on one process group: gloo matches collectives by their order on a
group. So the exchange gets process groups of its own, made once here. Making a group is
collective over the default group: every process must build its ``DiLoCo`` (the same way).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist


class Topology(NamedTuple):
    # the replicas, or this member's counterparts in the other islands; None: a member of a larger island
    # with no counterparts, which sends nothing across ([Note: islands])
    outer: dist.ProcessGroup | None
    island: dist.ProcessGroup | None  # this island's members (the exchange's own copy); None: plain replicas
    outer_rank: int  # this replica's (island's) index
    outer_size: int  # replicas (islands)
    island_rank: int
    island_size: int
    source: int | None  # global rank every parameter is broadcast from at construction over ``outer``
    owned: tuple[dist.ProcessGroup, ...]  # groups made here, destroyed by close()
    slices: int = 1  # the outer gradient's slices across an island: the smallest island's size
    equal_islands: bool = True
    island_source: int | None = None  # global rank of this island's first member; None: plain replicas

    @property
    def sends_across(self) -> bool:
        """Whether this process exchanges a slice with counterparts (False only in a larger island)."""
        return self.outer is not None

    def across(self) -> tuple[dist.ProcessGroup, int]:
        """The group to the counterparts and the rank broadcasts come from over it (when ``sends_across``)."""
        if self.outer is None or self.source is None:
            raise RuntimeError(
                f"DiLoCo on rank {dist.get_rank()} used the group across islands of a member that has no "
                "counterparts: the caller must check sends_across first."
            )
        return self.outer, self.source

    def within(self) -> tuple[dist.ProcessGroup, int]:
        """The island's own group and its first member's global rank (over islands only)."""
        if self.island is None or self.island_source is None:
            raise RuntimeError(
                f"DiLoCo on rank {dist.get_rank()} used the island group of a plain replica: the caller must "
                "check island_size > 1 (or equal_islands) first."
            )
        return self.island, self.island_source


def _new_group(ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    group: dist.ProcessGroup = dist.new_group(ranks, backend=backend)
    return group


def for_model(
    island_group: dist.ProcessGroup | None, group: dist.ProcessGroup | None, own_groups: bool, backend: str | None
) -> Topology:
    """Replicas over ``group``, or islands when the model is a DDP over ``island_group``."""
    if island_group is None:
        return replicas(group, own_groups, backend)
    if group is not None:
        raise ValueError(
            f"DiLoCo over islands builds the groups across islands itself (rank {dist.get_rank()}); pass group=None "
            "with a DistributedDataParallel model (its process group is the island)."
        )
    return islands(island_group, own_groups, backend)


def replicas(group: dist.ProcessGroup | None, own_groups: bool, backend: str | None = None) -> Topology:
    """``backend``: of the groups made here (``"gloo"`` on a GPU run: the exchange runs on host tensors)."""
    if group is None:
        if dist.group.WORLD is None:
            raise RuntimeError("DiLoCo needs torch.distributed initialised first (init_process_group).")
        group = dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    outer = _new_group(ranks, backend) if own_groups else group
    owned = (outer,) if own_groups else ()
    return Topology(outer, None, dist.get_rank(group), len(ranks), 0, 1, ranks[0], owned)


def islands(island_group: dist.ProcessGroup, own_groups: bool, backend: str | None = None) -> Topology:
    """Counterpart groups across the islands found by asking every process for its DDP's group."""
    rank = dist.get_rank()
    mine = tuple(dist.get_process_group_ranks(island_group))
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = sorted({tuple(ranks) for ranks in everyone if ranks is not None})
    overlapping = [ranks for ranks in found if set(ranks) & set(mine) and ranks != mine]
    if overlapping or sum(len(ranks) for ranks in found) != dist.get_world_size():
        raise ValueError(
            f"DiLoCo over islands needs the DDPs' process groups to split the processes: every process in "
            f"exactly one island; found {found} (rank {rank}). Build each island's DDP over its own new_group."
        )
    if len(found) < 2:
        raise ValueError(
            f"DiLoCo's model is a DistributedDataParallel over all {len(mine)} processes (rank {rank}): there is "
            "only one island, so nothing is exchanged across islands. Build the DDP over the process group of "
            "one island (dist.new_group(island_ranks)) or pass the plain module."
        )
    return over(found, island_group, own_groups, backend)


def over(
    found: list[tuple[int, ...]], island_group: dist.ProcessGroup, own_groups: bool, backend: str | None = None
) -> Topology:
    """The counterpart groups across the islands ``found`` (each island's global ranks, every process in one);
    ``island_group``: this process's island. One island alone is allowed here (gradsync.elastic_diloco after
    the other islands died): nothing then crosses, and the island all-gather still hands out the slices."""
    rank = dist.get_rank()
    mine = next(ranks for ranks in found if rank in ranks)
    island_rank = mine.index(rank)
    island_id = found.index(mine)
    slices = min(len(ranks) for ranks in found)  # [Note: islands]: the smallest island's members each carry one
    # Every process makes every group, in the same order: new_group is collective over the default group.
    counterparts = [_new_group([ranks[s] for ranks in found], backend) for s in range(slices)]
    island_copies = [_new_group(list(ranks), backend) for ranks in found] if own_groups else []
    has_counterparts = island_rank < slices
    outer = counterparts[island_rank] if has_counterparts else None
    source = found[0][island_rank] if has_counterparts else None
    island = island_copies[island_id] if own_groups else island_group
    owned = tuple(counterparts) + tuple(island_copies)
    equal = len({len(ranks) for ranks in found}) == 1
    return Topology(outer, island, island_id, len(found), island_rank, len(mine), source, owned, slices, equal, mine[0])


def close(topology: Topology) -> None:
    for group in topology.owned:
        dist.destroy_process_group(group)
