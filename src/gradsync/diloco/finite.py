"""A non-finite outer gradient: found before it reaches theta_global, and named.

[Note: a non-finite average is never applied]
One replica whose parameters hold a NaN (a diverged replica, a bad batch, a flipped bit) sends a
NaN in its outer gradient; averaged in, it makes ``theta_global`` NaN on every replica at once,
and for good. Plain ``DiLoCo`` has no way to go on without a replica, so it stops instead: at
every landing the average is checked (one ``isfinite`` pass over one fragment, on every process:
they all hold the same bits, so they all find the same thing), and only when it is not finite do
the processes all-gather, each about its own outer gradient, whether it was finite and the first
parameter that was not; then every one raises the same error, naming the replicas, their ranks
and the parameter, before the outer optimizer has touched ``theta_global``.
(``gradsync.elastic_diloco.FaultTolerantDiLoCo`` leaves such a replica out of the step instead:
[Note: bad contributions are left out] in elastic_diloco/contributions.py.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .outer_params import Fragment
from .topology import Topology


def first_nonfinite(delta: torch.Tensor, fragment: Fragment) -> int:
    """The index in ``fragment.names`` of the first parameter whose part of ``delta`` is not finite; -1: none."""
    bad = [i for i, part in enumerate(delta.split(fragment.sizes)) if not bool(torch.isfinite(part).all())]
    return bad[0] if bad else -1


def check_average(average: torch.Tensor, sent: torch.Tensor | None, fragment: Fragment, topology: Topology) -> None:
    """Raise, on every process, when ``average`` is not finite, naming the replicas whose outer gradient was not."""
    if bool(torch.isfinite(average).all()):
        return
    mine = first_nonfinite(sent, fragment) if sent is not None else -1
    group = None if topology.island is not None else topology.outer  # over islands: every process of the run
    # the default group of a GPU run may be NCCL, which carries GPU tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    every = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, torch.tensor([mine], dtype=torch.int64, device=device), group=group)
    culprits = [(rank, int(t.item())) for rank, t in enumerate(every) if int(t.item()) >= 0]
    ranks = [rank for rank, _ in culprits]
    who = f"the island(s) of global rank(s) {ranks}" if topology.island is not None else f"replica(s) {ranks}"
    detail = (
        f"the outer gradient of {who} holds a non-finite value (first in parameter {fragment.names[culprits[0][1]]!r})"
        if culprits
        else "every outer gradient was finite, but their average overflowed"
    )
    raise RuntimeError(
        f"DiLoCo's average outer gradient of fragment {fragment.index} is not finite (rank {dist.get_rank()}): "
        f"{detail}. theta_global was not changed. A replica that diverged poisons every replica through "
        "the average: lower its learning rate, clip its gradients, or resume from a checkpoint; "
        "gradsync.elastic_diloco.FaultTolerantDiLoCo leaves such a replica out of the outer step and goes on."
    )
