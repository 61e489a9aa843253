"""DiLoCo that goes on when a replica dies: outer steps decided together, cut-off exchanges redone.

``gradsync.diloco`` and ``gradsync.elastic`` are capabilities of one layer that know nothing of
each other; this package, one layer above, composes them. Usage::

    import gradsync
    from gradsync import elastic
    from gradsync.elastic_diloco import FaultTolerantDiLoCo

    run = elastic.init()                     # GRADSYNC_STORE, GRADSYNC_REPLICAS (TCPStore or etcd://)
    model = MyModel()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outer = FaultTolerantDiLoCo(model, inner, sync_every=50)   # a restarted replica is healed here
    while outer.step_count < steps:
        loss_fn(model(batch_for(outer.step_count)), y).backward()
        outer.step()                         # where the loop called inner.step()
        inner.zero_grad()
    outer.close()

See docs/diloco.md, "Fault tolerance".
"""

from .fault_tolerant import FaultTolerantDiLoCo

__all__ = ["FaultTolerantDiLoCo"]
