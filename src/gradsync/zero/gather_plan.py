"""How one layout's parameters are all-gathered: in parts, each waited for alone, in the forward's order.

[Note: gathered in parts]
A bucket holds its parameters in backward order, so a model's first layers are at its end, in the
range of the last rank; a bucket often holds most of a model (a 25 MiB cap). Gathered whole, the
forward's first module waits for that whole bucket before it can start, and only the time between
``step()`` and the forward hides the all-gather. So where an all-gather can go as several
exchanges (on gloo at two ranks, the segmented exchange: collectives/sharded.py), each bucket is
gathered in *parts* of ``PART_BYTES`` of every rank's range: part ``j`` carries elements
``[lo_j, hi_j)`` of each rank's range, all of them into place. The parts go out in the order the
first forward first used the parameters they hold (for a bucket, its last parts first), and a
module waits only for the parts holding what it reads, so the first layers compute while the later
parts are on the wire. Elsewhere (NCCL, gloo's ring all-gather above two ranks) a part is a whole
bucket, as before.

The plan also says which parameter a tensor is a view of (``locate``), for the record of what each
module reads (param_reads.py), from where each parameter lies in its bucket's flat buffer.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from ..engine.sharding import ShardLayout
from .dispatch_modes import storage_key

PART_BYTES = 1 << 20  # of every rank's range: large enough that a part costs no more than its bytes on the wire


class Part(NamedTuple):
    """Elements ``[lo, hi)`` of every rank's range of ``bucket``."""

    bucket: int
    lo: int
    hi: int


class Span(NamedTuple):
    """Where parameter ``param`` lies in its bucket's flat buffer (a strided view spans more than its numel)."""

    start: int
    stop: int
    param: int


class GatherPlan:
    """The parts of a layout (``part_numel``: elements per part; None: a bucket per part), where each parameter is."""

    def __init__(self, layout: ShardLayout, flats: list[torch.Tensor], spans: list[list[Span]], part_numel: int | None):
        self.parts: list[Part] = []
        self.of_bucket: list[list[int]] = []  # bucket -> its parts, first to last
        for b, size in enumerate(layout.shard_numel):
            step = size if part_numel is None else max(1, part_numel)
            first = len(self.parts)
            self.parts += [Part(b, lo, min(size, lo + step)) for lo in range(0, size, step)]
            self.of_bucket.append(list(range(first, len(self.parts))))
        self.of_param: dict[int, list[int]] = {}  # parameter -> the parts holding its elements
        self._where: dict[int, tuple[list[int], list[int], list[int]]] = {}  # storage -> starts, stops, params
        for b, bucket_spans in enumerate(spans):
            size, parts = layout.shard_numel[b], self.of_bucket[b]
            step = self.parts[parts[0]].hi  # the first part's length: every part's but the last
            for span in bucket_spans:
                held = set()
                for r in range(span.start // size, (span.stop - 1) // size + 1):
                    lo, hi = max(span.start, r * size) - r * size, min(span.stop, (r + 1) * size) - r * size
                    held.update(parts[lo // step : (hi - 1) // step + 1])
                self.of_param[span.param] = sorted(held)
            ordered = sorted(bucket_spans)
            self._where[storage_key(flats[b])] = ([s.start for s in ordered], [s.stop for s in ordered],
                                                  [s.param for s in ordered])  # fmt: skip

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The index of the parameter ``tensor`` is, or is a view of; None if it is none of them."""
        where = self._where.get(storage_key(tensor))
        if where is None:
            return None
        starts, stops, params = where
        offset = tensor.storage_offset()
        k = bisect.bisect_right(starts, offset) - 1
        return params[k] if k >= 0 and offset < stops[k] else None

    def parts_of(self, params: set[int]) -> list[int]:
        return sorted({part for param in params for part in self.of_param.get(param, ())})

    def order(self, first_use: list[int]) -> list[int]:
        """Every part, in the order the forward first used a parameter it holds; then the rest, later ones first."""
        ordered = dict.fromkeys(part for param in first_use for part in reversed(self.of_param.get(param, ())))
        return list(ordered) + [part for part in reversed(range(len(self.parts))) if part not in ordered]

    def bucket_order(self, b: int) -> list[int]:
        """Bucket ``b``'s parts, its last first (parameters are in backward order: the forward starts at the end)."""
        return list(reversed(self.of_bucket[b]))
