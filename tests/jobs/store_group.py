"""One rank of a gloo group rendezvoused through a store given by address (tests/test_store_conformance.py).

    python tests/jobs/store_group.py ADDRESS PREFIX RANK WORLD

Builds the default group on ``PrefixStore(PREFIX, store)``, all-reduces its rank + 1 and a
broadcast from rank 0, and prints both as JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.elastic.backends import connect


def main() -> None:
    address, prefix, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = dist.PrefixStore(prefix, connect(address, timedelta(seconds=30)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    sent = [f"from rank {rank}"]
    dist.broadcast_object_list(sent, src=0)
    dist.barrier()
    print(json.dumps({"rank": rank, "sum": total.item(), "broadcast": sent[0]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
