"""The model's buffers at outer steps: averaged across replicas, or left to each replica.

[Note: buffers at outer steps]
DiLoCo's outer step makes every replica's *parameters* agree; a module's buffers (BatchNorm's
running mean and variance, its batch counter) are not parameters and no outer gradient moves them.
Left alone, each replica's running statistics follow its own data only, and replicas that hold
the same ``theta_global`` would still evaluate differently. torch's DDP broadcasts rank 0's
buffers before every forward; DiLoCo's analogue, once per round of ``H`` inner steps (when the
round's last fragment lands), is to make them agree again:

* floating-point buffers become the mean over the replicas (accumulated in fp32 when they are
  half precision): running statistics are averages over batches, and the mean of the replicas'
  is the statistic of all of their batches, where rank 0's would drop the others';
* other buffers (BatchNorm's ``num_batches_tracked``) are counters, which an average would turn
  into fractions: they are broadcast from outer rank 0.

Only *persistent* buffers take part, those in the module's ``state_dict()``: a non-persistent one
(a causal mask, a rotary table) is derived, the same on every replica, and not worth a collective.
With ``buffers="local"`` each replica keeps its own (before this existed, the only behaviour).
Over islands the exchange runs between counterparts (one member of each island), each of which
holds its island's buffers; the island's DDP makes its members agree at its next forward as it
always does (``broadcast_buffers``). It is one blocking collective of the buffers' size per round,
run when no exchange is in flight; a model without buffers sends nothing.

In ``FaultTolerantDiLoCo`` the buffers are averaged inside the outer step's decision instead
([Note: buffers in a decided exchange] in elastic_diloco/committed_exchange.py): gathered and
summed in rank order over the generation's group, written only if the step commits, averaged
again over the survivors if it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.broadcast import broadcast_coalesced

BUFFER_MODES = ("average", "local")


class BufferAverage:
    """Makes the buffers of ``module`` agree over a process group (``average()``), once a round."""

    def __init__(self, module: nn.Module, mode: str) -> None:
        check_mode(mode)
        self.mode = mode
        named = persistent_buffers(module) if mode == "average" else []
        self.floating = [b for _, b in named if b.is_floating_point()]
        self.counters = [b for _, b in named if not b.is_floating_point()]
        self.sent_bytes = 0  # handed to the collectives, all rounds (a ring all-reduce moves about twice that)

    @property
    def to_average(self) -> bool:
        """Whether ``average()`` has anything to do (mode "average" and a model with buffers)."""
        return bool(self.floating or self.counters)

    @torch.no_grad()
    def average(self, group: dist.ProcessGroup, source: int) -> None:
        """Collective over ``group``: floating buffers averaged, counters broadcast from global rank ``source``."""
        if self.floating:
            flat = _flat(self.floating, torch.float32)
            dist.all_reduce(flat, group=group)
            self.sent_bytes += flat.numel() * flat.element_size()
            flat /= dist.get_world_size(group)
            self._write_floating(flat)
        broadcast_coalesced(self.counters, source, group)  # one collective for all of them
        self.sent_bytes += sum(c.numel() * c.element_size() for c in self.counters)

    @torch.no_grad()
    def snapshot(self) -> BufferValues:
        """This replica's buffers now: the floating ones flat in fp32, the counters flat in int64 (copies)."""
        floating = _flat(self.floating, torch.float32) if self.floating else None
        counters = _flat(self.counters, torch.int64) if self.counters else None
        return BufferValues(floating, counters)

    def average_in_rank_order(
        self, values: BufferValues, group: dist.ProcessGroup, wait: Callable[[dist.Work], object], works: list[Any]
    ) -> BufferValues:
        """The mean of every member's ``values`` over ``group``, summed in rank order (so that a one-process
        replay gets the same bits), and the counters of the group's rank 0. Collectives are issued async,
        appended to ``works`` and waited for with ``wait`` (the fault-tolerant mode's heartbeat-aware wait).
        Nothing is written: ``write`` does that once the outer step is decided."""
        size = dist.get_world_size(group)
        floating = counters = None
        if values.floating is not None:
            gathered = [torch.empty_like(values.floating) for _ in range(size)]
            works.append(dist.all_gather(gathered, values.floating, group=group, async_op=True))
            wait(works[-1])
            self.sent_bytes += values.floating.numel() * values.floating.element_size()
            floating = gathered[0].clone()
            for other in gathered[1:]:
                floating.add_(other)
            floating.div_(float(size))
        if values.counters is not None:
            counters = values.counters.clone()
            works.append(dist.broadcast(counters, dist.get_global_rank(group, 0), group=group, async_op=True))
            wait(works[-1])
            self.sent_bytes += counters.numel() * counters.element_size()
        return BufferValues(floating, counters)

    @torch.no_grad()
    def write(self, values: BufferValues) -> None:
        """Put ``values`` (an average) into the buffers."""
        if values.floating is not None:
            self._write_floating(values.floating)
        if values.counters is not None:
            offset = 0
            for counter in self.counters:
                counter.copy_(values.counters[offset : offset + counter.numel()].view_as(counter))
                offset += counter.numel()

    def _write_floating(self, flat: torch.Tensor) -> None:
        offset = 0
        for buffer in self.floating:
            buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


@dataclass(frozen=True)
class BufferValues:
    """Buffers taken out of a module: floating ones flat in fp32, counters flat in int64 (None: none)."""

    floating: torch.Tensor | None
    counters: torch.Tensor | None


def _flat(buffers: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The buffers' values in one new flat tensor of ``dtype``."""
    return torch.cat([b.detach().reshape(-1).to(dtype) for b in buffers])


def check_mode(mode: str) -> None:
    if mode not in BUFFER_MODES:
        raise ValueError(
            f"buffers must be one of {BUFFER_MODES} (average the model's buffers across replicas once every "
            f"sync_every inner steps, or keep each replica's own; docs/diloco.md), got {mode!r}."
        )


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``module.state_dict()`` holds, by name: the module's state, not what it derives."""
    saved = set(module.state_dict(keep_vars=True))
    return [(name, buffer) for name, buffer in module.named_buffers() if name in saved]
