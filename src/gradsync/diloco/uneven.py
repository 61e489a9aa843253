"""Uneven inputs: replicas that run out of data at different steps, joined at outer steps only.

[Note: joining at outer steps]
torch's ``Join`` makes every training step an all-reduce of "still here?" flags; DiLoCo's point is
that steps between outer steps send nothing, so the question is asked only where the replicas talk
anyway: with each exchange, two numbers per replica go along in one 8-byte all-reduce (only inside
``outer.join()``):

* ``weight``: 1 if the replica's outer gradient for this fragment holds inner steps not yet sent,
  that is if it trained after the fragment's previous exchange (``last_step > step - H``), else 0.
  The exchange sums ``weight_i * delta_i`` and divides by the sum of the weights: the average over
  the replicas that contributed. With no contributor there is no outer step (a zero outer gradient
  would still move theta_global through the momentum).
* ``active``: 1 while the replica is still in its training loop.

A replica whose loop ends leaves ``with outer.join():`` and, in ``__exit__``, goes on taking part
in the exchanges the schedule names, without inner steps, until ``F`` consecutive exchanges (one of
each fragment) counted no active replica. The counts are the same on every replica, so all of them
stop after the same exchange, and by then every fragment's last inner steps have been sent.
"""

from __future__ import annotations


class UnevenInputs:
    """The state of one ``outer.join()`` block on one replica."""

    __slots__ = ("sync_every", "fragments", "last_step", "quiet")

    def __init__(self, sync_every: int, fragments: int) -> None:
        self.sync_every = sync_every
        self.fragments = fragments
        self.last_step: int | None = None  # the replica's last inner step once its loop has ended
        self.quiet = 0  # consecutive landed exchanges that counted no active replica

    @property
    def training(self) -> bool:
        return self.last_step is None

    def flags(self, step: int) -> tuple[float, float]:
        """(weight, active) of this replica for the exchange starting after inner step ``step``."""
        if self.last_step is None:
            return 1.0, 1.0
        return (1.0 if self.last_step > step - self.sync_every else 0.0), 0.0

    def landed(self, active: int) -> None:
        self.quiet = 0 if active else self.quiet + 1

    @property
    def everyone_done(self) -> bool:
        return self.quiet >= self.fragments
