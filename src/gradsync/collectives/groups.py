"""Helper process groups made by their members alone.

[Note: groups made by their members]
torch's ``new_group`` is collective over the default group: every process calls it, with the same
ranks, in the same order, and the group is named by a counter. A DDP or a sharded optimizer over
a *subgroup* (one island of ``gradsync.diloco``), and its desync detector (made by the wrapper), are
built by that subgroup's members only, while
every other island builds its own at the same time: a helper group made there with ``new_group``
would give island A's group and island B's the same name, and their ranks would meet in the store
under one key (a hang, or worse, a group across islands). With ``use_local_synchronization=True``
torch names the group after its ranks and only they rendezvous. Over every process the ordinary
call is kept, so runs without subgroups make their groups exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def group_of_members(ranks: list[int], **kwargs: Any) -> dist.ProcessGroup:
    """A new process group over ``ranks`` (global ranks), made by those processes alone."""
    group: dist.ProcessGroup
    if len(ranks) == dist.get_world_size():
        group = dist.new_group(ranks, **kwargs)
    else:
        group = dist.new_group(ranks, use_local_synchronization=True, **kwargs)
    return group
