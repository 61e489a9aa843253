"""``static_graph=True``: how often each parameter's gradient hook fires in one backward.

With a static graph a parameter may get its gradient in several pieces (reentrant
checkpointing reuses a layer), so "ready" cannot mean "its hook fired once". The first
synced backward counts the firings per parameter (and reduces everything at its end);
from then on a parameter is ready when its hook has fired that many times, and parameters
that never fired are known to be unused without searching the graph.
"""

from __future__ import annotations

import enum

from . import errors


class Firing(enum.Enum):
    """What one hook firing means under a static graph."""

    FIRST_SEEN = "first seen"  # learning, and the first firing of this parameter in this backward
    LEARNING = "learning"  # learning: counted, nothing to do until the end of backward
    WAITING = "waiting"  # fewer firings than the first backward had
    READY = "ready"  # exactly as many as the first backward had: the gradient is final
    TOO_MANY = "too many"  # more than the first backward had: the graph changed


class StaticGraphCounts:
    """Hook firings per parameter in this backward, and the counts learnt in the first one."""

    def __init__(self, count: int) -> None:
        self.fired = [0] * count
        self.expected: list[int] | None = None  # None until the first synced backward ends
        self.unused: set[int] = set()  # parameters whose hook never fired in it

    @property
    def learning(self) -> bool:
        return self.expected is None

    def fire(self, index: int) -> Firing:
        self.fired[index] += 1
        fired = self.fired[index]
        if self.expected is None:
            return Firing.FIRST_SEEN if fired == 1 else Firing.LEARNING
        if fired == self.expected[index]:
            return Firing.READY
        return Firing.TOO_MANY if fired > self.expected[index] else Firing.WAITING

    def reset(self) -> None:
        self.fired = [0] * len(self.fired)

    def learn(self) -> None:
        """End of the first synced backward: these counts are what every later one must match."""
        self.expected = list(self.fired)
        self.unused = {i for i, n in enumerate(self.fired) if n == 0}

    def changed_error(self, name: str, index: int, rank: int, iteration: int) -> str:
        expected = self.expected[index] if self.expected else 0
        return errors.static_graph_changed(name, self.fired[index], expected, rank, iteration)
