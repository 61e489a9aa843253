"""Sharding each bucket over the ranks: which contiguous range of every bucket a rank owns.

[Note: shard each bucket]
Every bucket's flat buffer is zero-padded to a multiple of the world size ``N`` (``pad_multiple``
of the bucket set) and cut into ``N`` equal ranges; rank ``r`` owns range ``r`` of *every* bucket.
A bucket's reduce-scatter then starts from the same ready hook, in the same launch order, as its
all-reduce would, and each rank ends up with the average of its range. The ranges ignore
parameter boundaries: a parameter can be split over ranks, and a rank's range can hold pieces of
several parameters (of different param groups). Padding belongs to no parameter, so it is never
stepped and never counted (a ``Piece`` only covers parameter elements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bucket_set import BucketSet


@dataclass(frozen=True)
class Piece:
    """The part of parameter ``param`` (engine index) that lies in one rank's range of ``bucket``."""

    bucket: int
    param: int
    param_start: int  # first element, in the parameter's memory order
    shard_start: int  # where it lies in the rank's shard of the bucket
    length: int


class ShardLayout:
    """The ranges of one bucket assignment, for a group of ``world_size`` ranks."""

    def __init__(self, buckets: BucketSet, world_size: int) -> None:
        self.world_size = world_size
        self.numel = [storage.offsets[-1] + storage.params[-1].numel() for storage in buckets.storages]
        self.padded = [storage.flat.numel() for storage in buckets.storages]
        self.shard_numel = [padded // world_size for padded in self.padded]
        self._members = [list(zip(s.param_indices, s.offsets, (p.numel() for p in s.params))) for s in buckets.storages]

    def pieces(self, rank: int) -> list[Piece]:
        """Every piece ``rank`` owns, bucket by bucket, in shard order."""
        owned = []
        for b, members in enumerate(self._members):
            start = rank * self.shard_numel[b]
            stop = start + self.shard_numel[b]
            for index, offset, numel in members:
                lo, hi = max(start, offset), min(stop, offset + numel)
                if lo < hi:
                    owned.append(Piece(b, index, lo - offset, lo - start, hi - lo))
        return owned


def memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor``'s elements in memory order, the order its bucket view has them in."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())
