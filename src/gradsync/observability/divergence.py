"""Divergence detection: do the replicas still hold the same parameters and buffers?

[Note: divergence]
Every ``every`` synced forwards each rank fingerprints its parameters and buffers (two
int64 per tensor: the sum of the raw bits and a position-weighted sum, so any changed
bit almost surely changes it) and all ranks all-gather them. Cost per check: one pass
over the parameters and one all-gather of ``2 x tensors`` int64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_BIT_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 per tensor that change when any bit of the tensor changes."""
    out = torch.empty(2 * len(tensors), dtype=torch.int64)
    for i, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        bits = flat.view(_BIT_VIEWS[flat.element_size()]) if flat.is_floating_point() else flat
        bits = bits.to(device="cpu", dtype=torch.int64)
        out[2 * i] = bits.sum()
        out[2 * i + 1] = (bits * torch.arange(1, bits.numel() + 1, dtype=torch.int64)).sum()
    return out


class DivergenceCheck:
    """Raises on every rank when replicas stopped being identical."""

    def __init__(self, every: int, named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
        if every < 1:
            raise ValueError(f"check_divergence_every must be >= 1, got {every}")
        self.every = every
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.group = group

    def maybe_check(self, synced_forwards: int) -> None:
        if synced_forwards % self.every:
            return
        device = self.tensors[0].device if self.tensors[0].device.type != "cpu" else None
        mine = fingerprint(self.tensors)
        if device is not None:
            mine = mine.to(device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, mine, group=self.group)
        self._compare([g.cpu() for g in gathered], synced_forwards)

    def _compare(self, gathered: list[torch.Tensor], synced_forwards: int) -> None:
        reference = gathered[0]
        differing_ranks = [r for r, g in enumerate(gathered) if not torch.equal(g, reference)]
        if not differing_ranks:
            return
        first = min(int((gathered[r] != reference).nonzero()[0]) // 2 for r in differing_ranks)
        count = len({int(i) // 2 for r in differing_ranks for i in (gathered[r] != reference).nonzero()})
        raise RuntimeError(
            f"Replicas diverged before synced forward #{synced_forwards}: '{self.names[first]}' differs "
            f"between rank 0 and rank(s) {differing_ranks} ({count} tensor(s) differ in all; seen on rank "
            f"{dist.get_rank(self.group)}). Something changed the model differently per rank after the "
            "last synchronised backward: a rank-dependent optimizer step or learning rate, a random op "
            "on parameters, or a manual edit. Make every rank apply the same update."
        )
