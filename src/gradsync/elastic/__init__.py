"""Fault-tolerant data parallelism: training goes on when a rank dies; a replacement is healed.

Opt-in; plain ``gradsync.DistributedDataParallel`` is unchanged by it. Usage::

    from gradsync import DistributedDataParallel as DDP
    from gradsync import elastic

    run = elastic.init(store="storehost:29400", replicas=3)   # instead of init_process_group
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ft = elastic.FaultTolerant(ddp, opt, on_reconfigure=lambda rank, world, step: ...)
    while ft.step_count < steps:
        opt.zero_grad()
        loss_fn(ddp(batch_for(ft.step_count, ft.rank, ft.world_size)), y).backward()
        ft.step()        # True: committed by every member; the survivors redo a step a death interrupted
    ft.close()

The store is hosted outside the trainers: ``python -m gradsync.elastic.store --port 29400``, or
replicated by an etcd cluster (``store="etcd://h1:2379,h2:2379,h3:2379"``; ``EtcdStore``).
Each replica is started by its own launcher (``torchrun --nproc-per-node 1 --max-restarts N``),
so a dead one is restarted alone and joins again. See docs/fault_tolerance.md.
"""

from .etcd_store import EtcdStore, EtcdUnavailable
from .fault_tolerant import FaultTolerant
from .membership import Generation
from .run import ElasticRun, init
from .tcp_store import serve

__all__ = ["ElasticRun", "EtcdStore", "EtcdUnavailable", "FaultTolerant", "Generation", "init", "serve"]
