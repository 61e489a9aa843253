"""A sharded optimizer under ``join`` (uneven inputs): a rank out of data still owns its shards.

With plain DDP a rank that ran out of data only has to mirror the collectives of backward, and
its stale optimizer does not matter: the last rank to join broadcasts the model at the end. With
a sharded optimizer every rank owns one range of every bucket, which nobody else can step. So a
joined rank, after mirroring a synced backward (whose reduce-scatter leaves the others' average
in its shards), steps its shards and takes part in the all-gathers: the DDP's join hook calls
``ShardedOptimizer.shadow_step`` (wrapper/uneven_inputs.py), so the order of collectives is the
training ranks' own, whichever order the user lists the joinables in.

Two things a joined rank cannot see are handled here:

- the hyper-parameters the training ranks step with now (an LR scheduler moves them each step):
  while a join is on, every step all-reduces (max) each group's numeric hyper-parameters, to which
  a joined rank contributes ``-inf`` and takes the result;
- whether the training ranks clip: ``clip_grad_norm_`` raises inside a join.

Every rank is assumed to step after each synced backward, as torch's ``ZeroRedundancyOptimizer``
assumes under join.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class ShardedJoin:
    """Whether a join is on, and what the ranks of a sharded optimizer agree on inside one."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        # From the DDP's join hook (made when a Join is built) to its post_hook, on every rank.
        self.active = False

    def check_order(self, join_config: Any) -> None:
        """The DDP must come first: its forward speaks for the join, and its hook shadows the step."""
        if join_config.enable and join_config.is_first_joinable:
            raise RuntimeError(
                "A ShardedOptimizer was listed before its DistributedDataParallel in Join (or without it): the "
                "DDP's join hook shadows the optimizer's step, so it must come first. Use Join([ddp, optimizer]), "
                "or ddp.join(), which adds the optimizer itself."
            )

    def share_hyperparameters(self, param_groups: list[dict[str, Any]], joined: bool) -> None:
        """Every group's numeric hyper-parameters as the training ranks have them (one small all-reduce)."""
        slots = [(g, key) for g, group in enumerate(param_groups) for key in sorted(group) if _numeric(group[key])]
        values: list[float] = []
        for g, key in slots:
            value = param_groups[g][key]
            values.extend(value if isinstance(value, tuple) else (value,))
        flat = torch.tensor(values if not joined else [-math.inf] * len(values), dtype=torch.float64)
        flat = flat.to(self.device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        if not joined:
            return
        agreed = iter(flat.tolist())
        for g, key in slots:
            value = param_groups[g][key]
            if isinstance(value, tuple):
                param_groups[g][key] = tuple(type(v)(next(agreed)) for v in value)
            else:
                param_groups[g][key] = type(value)(next(agreed))


def _numeric(value: Any) -> bool:
    """A float or int hyper-parameter, or a tuple of them (Adam's betas); bools are flags, not numbers."""
    if isinstance(value, tuple):
        return bool(value) and all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
