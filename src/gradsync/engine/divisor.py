"""What a bucket's sum is divided by: the group's size, a fixed count, or the ranks still training."""

from __future__ import annotations

from typing import Any


class Divisor:
    """The average's denominator for the current backward.

    - by default the process group's size;
    - ``fixed``: the fault-tolerant mode's ``divisor=N`` (the same count whoever survives);
    - ``divide_next_pass_by``: one pass only, the fault-tolerant redo that leaves ranks with
      non-finite gradients out (they contribute zeros; the sum is divided by the others' count);
    - under ``join(divide_by_initial_world_size=False)``: the ranks still active, known from the
      forward's "still active" all-reduce, resolved at the first launch that needs it.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.fixed: float | None = None
        self._next_pass: float | None = None  # the next pass's count, then back to the above
        self._active_ranks: Any = None  # the future of the forward's all-reduce, until taken
        self._value = float(world_size)

    def reset(self) -> None:
        """A new backward: the group's size (or the fixed count) until told otherwise."""
        self._value = self._next_pass or self.fixed or float(self.world_size)
        self._next_pass = None

    def divide_next_pass_by(self, count: int) -> None:
        """The next pass (a redo, started after this call) divides by ``count``; the ones after it as before."""
        self._next_pass = float(count)

    def follow_active_ranks(self, still_active: Any) -> None:
        self._active_ranks = still_active

    def take(self) -> float:
        if self._active_ranks is not None:
            count = self._active_ranks.wait()
            count = count[0] if isinstance(count, list) else count
            self._value = float(count.item())
            self._active_ranks = None
        return self._value
