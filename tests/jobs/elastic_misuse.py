"""One process, one replica: the fault-tolerant mode's argument errors (tests/test_elastic.py)."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync import elastic
from gradsync.hooks import allreduce_hook


def message(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except (TypeError, ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def main() -> None:
    store = sys.argv[1]
    found = {
        "no store": message(lambda: elastic.init(store="", replicas=1)),
        "no replicas": message(lambda: elastic.init(store=store, replicas=0)),
        "min above replicas": message(lambda: elastic.init(store=store, replicas=1, min_replicas=2)),
        "bad address": message(lambda: elastic.init(store="nohostport", replicas=1)),
    }
    elastic.init(store=store, run_id="misuse", replicas=1)
    opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    views = DDP(nn.Linear(4, 4), gradient_as_bucket_view=True)
    found["bucket views"] = message(lambda: elastic.FaultTolerant(views, opt(views)))
    checked = DDP(nn.Linear(4, 4))
    checked.enable_desync_detection(timeout_s=5)
    found["desync detection"] = message(lambda: elastic.FaultTolerant(checked, opt(checked)))
    plain = DDP(nn.Linear(4, 4))
    found["not gradsync"] = message(lambda: elastic.FaultTolerant(nn.Linear(4, 4), opt(plain)))
    found["bad divisor"] = message(lambda: elastic.FaultTolerant(plain, opt(plain), divisor="all"))
    hooked = DDP(nn.Linear(4, 4))
    hooked.register_comm_hook(None, allreduce_hook)
    found["fixed divisor with a hook"] = message(lambda: elastic.FaultTolerant(hooked, opt(hooked), divisor=2))
    stateful = DDP(nn.Linear(4, 4))
    stateful.register_comm_hook(object(), lambda state, bucket: allreduce_hook(None, bucket))
    found["unknown hook state"] = message(lambda: elastic.FaultTolerant(stateful, opt(stateful)))
    ft = elastic.FaultTolerant(plain, opt(plain))
    found["desync detection later"] = message(lambda: plain.enable_desync_detection(timeout_s=5))
    found["step before backward"] = message(ft.step)
    plain(torch.randn(2, 4)).sum().backward()
    found["one replica trains"] = str(ft.step()) + f" step_count={ft.step_count} world={ft.world_size}"
    ft.close()
    print(json.dumps(found))


if __name__ == "__main__":
    main()
