"""The idea without the optimisation: one blocking all-reduce per parameter.

Kept as documentation and as an oracle for parity tests and benchmarks: no buckets,
no overlap, no hooks; after ``backward()`` call ``average_gradients()``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn


class NaiveDataParallel(nn.Module):
    """Broadcast rank 0's parameters once; average every ``.grad`` on request."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group or cast(dist.ProcessGroup, dist.group.WORLD)
        src = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=src, group=self.process_group)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def average_gradients(self) -> None:
        world_size = dist.get_world_size(self.process_group)
        for param in self.module.parameters():
            if param.grad is None:
                continue
            param.grad.div_(world_size)
            dist.all_reduce(param.grad, group=self.process_group)
