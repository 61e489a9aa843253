"""What the ZeRO tests share: two param groups the shards straddle, and how replicas are compared."""

from __future__ import annotations

import torch
from torch import nn

from models import all_gather_flat


def two_groups(model: nn.Module, lr: float) -> list[dict]:
    """Two param groups with different lr and weight decay: the shards straddle them."""
    head = [p for n, p in model.named_parameters() if n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
    return [{"params": rest}, {"params": head, "lr": lr / 2, "weight_decay": 0.0}]


def max_relative_difference(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


def identical_across_ranks(model: nn.Module) -> bool:
    replicas = all_gather_flat(list(model.parameters()))
    return all(torch.equal(replicas[0], r) for r in replicas)
