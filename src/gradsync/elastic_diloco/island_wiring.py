"""A fault-tolerant DiLoCo process's island: its DDP over each generation's island group, DiLoCo's groups across.

[Note: an island rewired per generation]
Every generation has a default group of its own (elastic/membership.py), and the island's DDP
group and DiLoCo's counterpart groups are subgroups of it, so each generation makes them anew
(``dist.new_group``, every process in the same order: every island's group, then the counterpart
groups, then with ``delay > 0`` the exchange's own copies of the islands' groups, [Note: groups of
our own] in diloco/topology.py). The island's DDP is rebuilt over its new group keeping its
bucket layout (order, caps, whether it was rebuilt): its members keep agreeing on the buckets, and
a surviving island loses nothing of its own by another island's death. The old groups, the old
engine and the old topology are kept alive, never destroyed: one may hold an operation stuck on a
hung peer, and freeing it would block until that times out ([Note: forming a generation]).
A plain replica (an island of one, no DDP) exchanges over the generation's default group itself,
as it always did.
"""

from __future__ import annotations

import torch.distributed as dist

from ..diloco import topology as diloco_topology
from ..elastic import hook_state, membership
from ..elastic.island_watch import IslandWatch
from ..elastic.run import ElasticRun, island_groups
from ..wrapper.data_parallel import DataParallelWrapper
from .inner_state import InnerState


class IslandWiring:
    """The groups of one process for each generation, and the watch over its island mates."""

    def __init__(self, run: ElasticRun, island: DataParallelWrapper | None, delay: int, inner: InnerState) -> None:
        _check_island(run, island)
        self.run = run
        self.island = island
        self.inner = inner  # a ShardedOptimizer's shards follow the DDP to each group
        self.own_groups = delay > 0
        self.watch = IslandWatch(run)
        self._made_for = run.island_group_of  # the generation the DDP's group was made for
        self._topology: diloco_topology.Topology | None = None

    def topology(self) -> diloco_topology.Topology:
        """DiLoCo's topology over the current generation (the island's DDP moved to its new group first)."""
        if self._topology is not None:
            membership.bury(self._topology)  # its groups may hold an operation stuck on a dead peer
        if self.island is None:
            self._topology = diloco_topology.replicas(None, own_groups=False)
            return self._topology
        generation = self.run.generation
        found: list[tuple[int, ...]]
        if generation is None:  # a joiner, alone until admitted: an island of one process for now
            found = [(0,)]
        else:
            found = [tuple(ranks) for ranks in generation.island_ranks()]
            if generation.number != self._made_for:
                self._regroup(island_groups(generation, self.run.uuid))
                self._made_for = generation.number
            self.watch.follow(generation)
        self._topology = diloco_topology.over(found, self.island.process_group, self.own_groups)
        return self._topology

    def _regroup(self, group: dist.ProcessGroup) -> None:
        """The island's DDP over ``group``, keeping its bucket layout and its comm hook (and ZeRO's shards)."""
        ddp = self.island
        assert ddp is not None
        layout = ddp.engine.layout.describe()
        membership.bury(ddp.engine)  # with its buckets and the work handles of its last steps
        membership.bury(ddp.process_group)
        ddp.rebuild_engine(group, caps=tuple(layout["caps"]))
        engine = ddp.engine
        if engine.reduction.hook is not None:
            engine.reduction.state = hook_state.rebind(engine.reduction.state, group)
        engine.adopt_layout(layout["order"], layout["caps"], layout["rebuilt"])
        self.inner.regrouped()

    def close(self) -> None:
        self.watch.stop()


def _check_island(run: ElasticRun, island: DataParallelWrapper | None) -> None:
    rank, seat = dist.get_rank(), run.seat
    named = run.island_group is not None
    if island is None and named and seat is not None and seat.size > 1:
        raise ValueError(
            f"FaultTolerantDiLoCo on rank {rank}: this process is member {seat.rank} of island {seat.island!r} "
            f"({seat.size} processes train one replica), so its model must be a gradsync DistributedDataParallel "
            "over the island: DDP(model, process_group=run.island_group)."
        )
    if island is not None and not named:
        raise ValueError(
            f"FaultTolerantDiLoCo on rank {rank} got a DistributedDataParallel, but this process was not given an "
            "island: pass island='name' to gradsync.elastic.init (or set GRADSYNC_ISLAND; launch one torchrun per "
            "island) and build the DDP over run.island_group. A plain replica passes the plain module."
        )
    if island is not None and island.process_group is not run.island_group:
        raise ValueError(
            f"FaultTolerantDiLoCo on rank {rank}: the DistributedDataParallel must be built over the island's group "
            "that gradsync.elastic.init made: DDP(model, process_group=run.island_group). Its members change with "
            "the run's generations, and the DDP is moved to each generation's island group."
        )
