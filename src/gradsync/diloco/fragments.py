"""Which layers form which fragment, and after which inner steps each fragment is exchanged.

Pure policy: counts in, indices out; no torch (the layers themselves are found in outer_params.py).

[Note: the fragment schedule]
``H = sync_every`` inner steps make one round; the ``F = fragments`` fragments are spread evenly
over it, ``period = H / F`` steps apart. Fragment ``p`` starts its exchange after inner step
``t = (p + 1) * period + k * H`` (k = 0, 1, ...) and lands ``delay`` inner steps later: its outer
step is applied then and merged into the local parameters. So every fragment is synced once per
``H`` steps, at its own offset, and fragment ``F - 1`` syncs after steps ``H, 2H, ...`` (with
``F = 1`` that is plain DiLoCo / local SGD with period ``H``). ``delay < period`` keeps at most one
fragment in flight: it lands before the next one starts, so the bytes in flight never exceed one
fragment's. The step counter is the number of ``DiLoCo.step()`` calls, which is what makes the
schedule the same on every replica without any message.

[Note: strided fragments]
Layer ``i`` (in the module's registration order) goes to fragment ``i mod F``. Streaming DiLoCo
(arXiv 2501.18512, Fig. 4) found strided fragments better than contiguous ones: a fragment then
holds layers from the whole depth of the network rather than one end of it.
"""

from __future__ import annotations

from typing import NamedTuple


def strided(layer_count: int, fragments: int) -> list[list[int]]:
    """Layer indices of each fragment: layer ``i`` in fragment ``i % fragments``."""
    if not 1 <= fragments <= layer_count:
        raise ValueError(
            f"fragments={fragments} needs 1 <= fragments <= the number of layers holding parameters "
            f"({layer_count}); every fragment needs at least one layer. Pass a smaller fragments."
        )
    return [list(range(p, layer_count, fragments)) for p in range(fragments)]


class Schedule(NamedTuple):
    """When each fragment starts and lands (see [Note: the fragment schedule])."""

    sync_every: int
    fragments: int
    delay: int

    @classmethod
    def checked(cls, sync_every: int, fragments: int, delay: int) -> Schedule:
        for name, value in (("sync_every", sync_every), ("fragments", fragments), ("delay", delay)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
        if sync_every < 1 or fragments < 1:
            raise ValueError(
                f"sync_every and fragments must be >= 1, got sync_every={sync_every}, fragments={fragments}."
            )
        if sync_every % fragments:
            nearest = sync_every - sync_every % fragments or fragments
            raise ValueError(
                f"sync_every={sync_every} must be a multiple of fragments={fragments}: the fragments are synced "
                f"{sync_every}/{fragments} inner steps apart. Pass e.g. sync_every={nearest}."
            )
        period = sync_every // fragments
        if not 0 <= delay < period:
            raise ValueError(
                f"delay={delay} must satisfy 0 <= delay < sync_every / fragments = {period}: a fragment's exchange "
                "has to land before the next fragment's starts (one fragment in flight at a time)."
            )
        return cls(sync_every, fragments, delay)

    @property
    def period(self) -> int:
        return self.sync_every // self.fragments

    def starting_after(self, step: int) -> int | None:
        """The fragment whose exchange starts after inner step ``step`` (1-based), if any."""
        if step < 1 or step % self.period:
            return None
        return (step // self.period - 1) % self.fragments

    def landing_after(self, step: int) -> int | None:
        """The fragment whose exchange lands (outer step, merge) after inner step ``step``, if any."""
        return self.starting_after(step - self.delay)

    def next_event(self, step: int) -> int:
        """The first inner step after ``step`` at which a fragment starts or lands."""
        next_start = (step // self.period + 1) * self.period
        next_land = max(((step - self.delay) // self.period + 1) * self.period + self.delay, self.period + self.delay)
        return min(next_start, next_land)
