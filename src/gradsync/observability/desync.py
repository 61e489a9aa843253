"""Desync detection: ranks agree on every collective before issuing it.

[Note: desync]
In desync mode, before every collective the reducer is about to issue, ranks pass a
``monitored_barrier`` on a gloo helper group (which names the ranks that did not
arrive in time) and all-gather a fingerprint of the collective (what, which synced
forward, which bucket, how many elements). A mismatch is raised on every rank with
each rank's position. It costs two extra collectives per collective: a debug mode.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist


class Position(NamedTuple):
    """Which collective a rank is about to issue."""

    what: str  # e.g. "all-reduce of bucket 2"
    synced_forward: int
    numel: int
    dtype: str

    def describe(self) -> str:
        return f"{self.what} ({self.numel} x {self.dtype}) for synced forward #{self.synced_forward}"


class DesyncDetector:
    """Agree on every collective before issuing it; name who is where when ranks differ."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, helper: dist.ProcessGroup) -> None:
        """``helper``: a gloo group over ``group``'s ranks (monitored_barrier needs gloo, whatever backend the
        training group uses), made by whoever builds the detector ([Note: groups made by their members])."""
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self.helper = helper
        self.rank = dist.get_rank(group)

    def check(self, position: Position) -> None:
        try:
            dist.monitored_barrier(self.helper, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"gradsync desync: rank {self.rank} is about to issue {position.describe()}, but not every "
                f"rank reached a collective within {self.timeout.total_seconds():.0f}s: {error}. A rank may have "
                "crashed, hung, or skipped a forward/backward the others ran."
            ) from error
        positions: list[Position | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(positions, position, group=self.helper)
        if all(p == positions[0] for p in positions):
            return
        where = "; ".join(f"rank {r} is about to issue {p.describe()}" for r, p in enumerate(positions) if p)
        raise RuntimeError(
            f"gradsync desync: ranks disagree on the next collective: {where}. Every rank must run the "
            "same sequence of synced forwards and backwards (a skipped backward, a rank-dependent "
            "no_sync, or a model that uses different parameters per rank?)."
        )
