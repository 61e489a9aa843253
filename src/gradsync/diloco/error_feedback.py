"""Error feedback for a lossy wire: what rounding took from one exchange goes out with the next.

[Note: error feedback]
With ``wire="bf16"`` or ``"int8"`` an exchange rounds twice ([Note: the exchange, step by step] in
exchange.py): each replica's contribution, rounded by its sender, and each piece's average, rounded
by the piece's owner before it is sent back. Rounding to nearest drops what lies below half a
step of the chunk's scale, and an outer gradient's small components are dropped again in every
round: the outer optimizer never sees them. With ``DiLoCo(error_feedback=True)`` each process keeps,
per fragment, what its own rounding removed, and adds it to what it rounds for that fragment next:

* as a sender: ``c = delta + r_sent``; ``c`` is encoded; ``r_sent <- c - decode(encode(c))``;
* as the owner of a piece: ``a = mean + r_owned``; ``a`` is encoded and sent back;
  ``r_owned <- a - decode(encode(a))`` on that piece.

Summed over rounds, the averages applied equal the ones meant minus what the residuals still hold
(the sums telescope), so a component is delayed, never lost. Each rounding is compensated by
exactly the process that made it, and everyone still decodes the same bytes: ``theta_global``
stays the same bits on every replica. A replica whose data ended inside ``outer.join()`` sends
zeros and keeps its sender residual unchanged.

The residuals are this process's own state (in its ``DiLoCo.state_dict()``, so a resumed run
goes on bitwise), held as the exchange computes them and *committed* when its average is applied,
so an exchange that is taken back starts again from the same residuals. They cost two fp32 copies
of the process's share of the model (its island slice). An owned piece's residual covers the
piece this process owned in the last exchange; a process that owns another piece later (fewer
replicas) adds only the part that falls in its new piece and drops the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Residuals(NamedTuple):
    """One fragment's residuals on this process, both as long as its island slice of the fragment."""

    sent: torch.Tensor  # what rounding removed from this process's contribution
    owned: torch.Tensor  # what rounding removed from the average of the piece it owned (zeros elsewhere)


def slice_length(numel: int, parts: int, index: int) -> int:
    """The length of ``torch.tensor_split(t, parts)[index]`` for a ``t`` of ``numel`` values."""
    return numel // parts + (1 if index < numel % parts else 0)


class ErrorFeedback:
    """This process's residuals, one pair per fragment ([Note: error feedback])."""

    def __init__(self, lengths: list[int]) -> None:
        self.residuals = [Residuals(torch.zeros(n), torch.zeros(n)) for n in lengths]

    def of(self, fragment: int) -> Residuals:
        return self.residuals[fragment]

    def commit(self, fragment: int, residuals: Residuals) -> None:
        """The exchange that computed ``residuals`` was applied: they are the fragment's from now on."""
        self.residuals[fragment] = residuals

    def reset(self) -> None:
        """No residuals: a process that has rounded nothing yet (a replica healed from another)."""
        self.residuals = [Residuals(torch.zeros_like(r.sent), torch.zeros_like(r.owned)) for r in self.residuals]

    def state_dict(self) -> list[dict[str, torch.Tensor]]:
        return [{"sent": r.sent.clone(), "owned": r.owned.clone()} for r in self.residuals]

    def load_state_dict(self, state: list[dict[str, Any]], rank: int) -> None:
        lengths = [r.sent.numel() for r in self.residuals]
        saved = [d["sent"].numel() for d in state]
        if saved != lengths:
            raise ValueError(
                f"This DiLoCo checkpoint's error-feedback residuals (rank {rank}) cover slices of {saved} values, "
                f"this process's fragments {lengths}: it was saved by a process with another share of the model "
                "(another island size or rank). Resume each process from its own checkpoint."
            )
        self.residuals = [Residuals(d["sent"].clone(), d["owned"].clone()) for d in state]
