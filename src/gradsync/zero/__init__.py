"""Optimizer state and gradients sharded over the ranks, inside gradsync's own buckets (ZeRO-1 and ZeRO-2).

    optimizer = gradsync.zero.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)

See sharded_optimizer.py ([Note: one all-reduce's cost]) and docs/zero.md.
"""

from .sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
