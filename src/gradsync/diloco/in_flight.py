"""An outer exchange in flight: what DiLoCo keeps of it until it lands, and how a checkpoint holds it.

[Note: a checkpoint with an exchange in flight]
With ``delay > 0`` a fragment's exchange may be running when the loop saves a checkpoint. Saving
waits for it (collective: every replica has the same exchange in flight at the same inner step)
and keeps what its landing needs: the average (or None when nobody contributed), how many replicas
are still in their loop, this process's error-feedback residuals and, for
``merge="keep_inner_steps"``, the outer gradient it sent. Restoring holds that as an exchange that
has already finished, applied at the step it would have landed; so a resumed run continues bit for
bit like one that never stopped, and the saving run too (its exchange is held the same way).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .error_feedback import Residuals
from .exchange import Averaged, PendingAverage
from .host_state import StagedDelta, ready


class InFlight(NamedTuple):
    fragment: int
    started: int  # the inner step after which its exchange started
    average: PendingAverage
    # this replica's outer gradient as it started (merge="keep_inner_steps"); on a GPU run, on its way to the host
    sent: torch.Tensor | StagedDelta | None


def held(in_flight: InFlight, averaged: Averaged) -> InFlight:
    """``in_flight`` with its exchange's result ``averaged`` kept as a finished one."""
    return in_flight._replace(average=_finished(averaged))


def to_state(in_flight: InFlight, averaged: Averaged) -> dict[str, Any]:
    """What a checkpoint keeps of ``in_flight``, whose exchange ended with ``averaged`` (copies)."""
    return {
        "fragment": in_flight.fragment,
        "started": in_flight.started,
        "average": None if averaged.values is None else averaged.values.clone(),
        "active": averaged.active,
        "sent": None if in_flight.sent is None else ready(in_flight.sent).clone(),
        "residuals": None if averaged.residuals is None else _cloned(averaged.residuals),
    }


def from_state(saved: dict[str, Any], merge: str) -> InFlight:
    """The exchange a checkpoint kept, finished, to land at its step."""
    values = None if saved["average"] is None else saved["average"].clone()
    residuals = saved.get("residuals")
    averaged = Averaged(values, saved["active"], None if residuals is None else _cloned(residuals))
    sent = saved.get("sent")  # absent from checkpoints made before merge="keep_inner_steps"
    if sent is None and merge == "keep_inner_steps":
        raise ValueError(
            f"This DiLoCo checkpoint (rank {dist.get_rank()}) has an exchange in flight but not the outer "
            "gradient merge='keep_inner_steps' needs at landing: it was saved by an older gradsync; resume "
            "it with merge='mix'."
        )
    sent = None if sent is None else sent.clone()
    return InFlight(saved["fragment"], saved["started"], _finished(averaged), sent)


def _cloned(residuals: Residuals) -> Residuals:
    return Residuals(residuals.sent.clone(), residuals.owned.clone())


def _finished(value: Averaged) -> Future[Averaged]:
    future: Future[Averaged] = Future()
    future.set_result(value)
    return future
