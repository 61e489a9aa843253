"""Calls a type checker must refuse: each line below is an error that mypy has to report.

Each wrong call carries ``# type: ignore[<error code>]``. The configuration warns about an
ignore that silences nothing (``warn_unused_ignores``, part of ``strict``), so if mypy stopped
reporting one of these errors, because gradsync's hints became ``Any`` (no py.typed in the wheel,
an untyped signature) or too loose, the ignore is unused and ``make typecheck`` / ``make
wheel-check`` fail. Never run; only checked.
"""

from __future__ import annotations

import torch
from torch import nn

import gradsync
import gradsync.diloco
import gradsync.zero
from gradsync.hooks import PowerSGDState


def wrong_arguments(model: nn.Module) -> None:
    gradsync.DistributedDataParallel("not a module")  # type: ignore[arg-type]
    gradsync.DistributedDataParallel(model, bucket_cap_mb=[25])  # type: ignore[arg-type]
    gradsync.DistributedDataParallel(model, find_unused_parameters="yes")  # type: ignore[arg-type]
    gradsync.DistributedDataParallel(model, no_such_argument=True)  # type: ignore[call-arg]
    ddp = gradsync.DistributedDataParallel(model)
    ddp.stats().iterations.upper()  # type: ignore[attr-defined]
    PowerSGDState(process_group=None, matrix_approximation_rank="4")  # type: ignore[arg-type]
    inner = torch.optim.AdamW(model.parameters())
    gradsync.diloco.DiLoCo(model, inner, sync_every="50")  # type: ignore[arg-type]
    gradsync.diloco.DiLoCo(inner, model, sync_every=50)  # type: ignore[arg-type]
    gradsync.zero.ShardedOptimizer(ddp, torch.optim.AdamW(model.parameters()))  # type: ignore[arg-type]
