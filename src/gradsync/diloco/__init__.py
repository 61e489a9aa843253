"""Training across slow links: local SGD and (Streaming) DiLoCo (docs/diloco.md).

    import gradsync.diloco
    outer = gradsync.diloco.DiLoCo(model, inner_optimizer, sync_every=50)   # outer Nesterov 0.7 / 0.9
    for batch in batches:
        inner_optimizer.zero_grad()
        loss_fn(model(batch.x), batch.y).backward()
        outer.step()          # instead of inner_optimizer.step()

``model`` is a plain module (each process a replica) or a gradsync DistributedDataParallel whose
process group is one island. ``fragments``, ``delay`` and ``alpha`` give Streaming DiLoCo;
``wire`` is the outer exchange's format ("fp32", "bf16", "int8", "int4"), ``error_feedback=True`` sends what
a lossy format's rounding removed with the next exchange (error_feedback.py). See outer.py's
[Note: DiLoCo in one paragraph].
"""

from .exchange import WireCount
from .local_sgd import LocalSGD, averaging
from .outer import DiLoCo, nesterov

__all__ = ["DiLoCo", "LocalSGD", "WireCount", "averaging", "nesterov"]
