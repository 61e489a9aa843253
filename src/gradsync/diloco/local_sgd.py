"""``LocalSGD``: DiLoCo whose outer step is parameter averaging.

Outer SGD with lr 1 and no momentum steps ``theta_global`` to ``theta_global - mean(delta_i) =
mean(theta_local_i)``: the replicas' parameters averaged every ``sync_every`` steps, as torch's
``PeriodicModelAverager`` does ([Note: DiLoCo in one paragraph] in outer.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .outer import DiLoCo


def averaging(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Outer SGD with lr 1 and no momentum: the outer step is parameter averaging."""
    return torch.optim.SGD(params, lr=1.0)


class LocalSGD(DiLoCo):
    """Local SGD: every replica steps on its own, and every ``sync_every`` steps the parameters are
    averaged (DiLoCo with outer SGD, lr 1, no momentum)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        fragments: int | Sequence[object] = 1,
        delay: int = 0,
        alpha: float = 0.5,
        wire: str = "fp32",
        group: dist.ProcessGroup | None = None,
        *,
        merge: str = "mix",
        error_feedback: bool = False,
        buffers: str = "average",
        outer_state: str = "host",
    ) -> None:
        super().__init__(
            model,
            inner_optimizer,
            sync_every,
            averaging,
            fragments,
            delay,
            alpha,
            wire,
            group,
            merge=merge,
            error_feedback=error_feedback,
            buffers=buffers,
            outer_state=outer_state,
        )
