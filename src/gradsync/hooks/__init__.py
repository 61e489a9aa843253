"""gradsync's communication hooks: ``ddp.register_comm_hook(state, hook)``.

One module per family, each hook's docstring a tuning guide:

=====================  ==========================  =====================================
hook                   state                       bytes vs fp32 all-reduce (W ranks)
=====================  ==========================  =====================================
allreduce_hook         ProcessGroup / None /       1 (the baseline)
                       AllReduceState
fp16_compress_hook     as allreduce_hook           1/2
bf16_compress_hook     as allreduce_hook           1/2
compress_wrapper(h,t)  h's state                   h's bytes at t's element size
powersgd_hook          PowerSGDState               r (n + m) / (n m) per weight matrix
batched_powersgd_hook  PowerSGDState               ~2 r / sqrt(n) per bucket
topk_hook              TopKState                   W ratio (pairs of int32 + value)
int8_hook              Int8State                   W / 8
=====================  ==========================  =====================================

Every state records the bytes it sent per iteration in ``state.wire`` (``WireStats``);
for the first three, pass an ``AllReduceState`` instead of a process group to get it.

Example::

    from gradsync import DistributedDataParallel as DDP
    from gradsync.hooks import PowerSGDState, powersgd_hook

    ddp = DDP(model)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_iter=500)
    ddp.register_comm_hook(state, powersgd_hook)
    ...
    print(state.wire.mean_bytes_per_iteration())
"""

from .allreduce import AllReduceState, allreduce_hook
from .compression import bf16_compress_hook, compress_wrapper, fp16_compress_hook
from .memory import BucketMemory
from .powersgd import PowerSGDState, batched_powersgd_hook, powersgd_hook
from .quantize import Int8State, int8_hook
from .topk import TopKState, topk_hook
from .wire import WireStats

__all__ = [
    "AllReduceState",
    "BucketMemory",
    "Int8State",
    "PowerSGDState",
    "TopKState",
    "WireStats",
    "allreduce_hook",
    "batched_powersgd_hook",
    "bf16_compress_hook",
    "compress_wrapper",
    "fp16_compress_hook",
    "int8_hook",
    "powersgd_hook",
    "topk_hook",
]
