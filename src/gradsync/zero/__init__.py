"""Optimizer state and gradients sharded over the ranks, inside gradsync's own buckets (ZeRO-1 and ZeRO-2).

    optimizer = gradsync.zero.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3)
    gradsync.zero.save_sharded(path, ddp, optimizer)   # each rank writes its own shards
    gradsync.zero.load_sharded(path, ddp, optimizer)   # at any world size

See sharded_optimizer.py ([Note: one all-reduce's cost]), checkpoint.py and docs/zero.md.
"""

from .checkpoint import load_sharded, save_sharded
from .sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer", "load_sharded", "save_sharded"]
