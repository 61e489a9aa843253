"""Which collectives the reducer issues, in which order, recorded at torch.distributed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from gradsync import DistributedDataParallel as DDP

from harness import run_distributed


@contextmanager
def recording() -> Iterator[list[tuple[str, int, torch.dtype]]]:
    """Record (op, numel, dtype) of every all_reduce and broadcast issued inside."""
    calls: list[tuple[str, int, torch.dtype]] = []
    originals = {"all_reduce": dist.all_reduce, "broadcast": dist.broadcast}

    def wrap(op: str):
        def recorded(tensor, *args, **kwargs):
            calls.append((op, tensor.numel(), tensor.dtype))
            return originals[op](tensor, *args, **kwargs)

        return recorded

    for op in originals:
        setattr(dist, op, wrap(op))
    try:
        yield calls
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)


class OutOfOrder(nn.Module):
    """Registered b then a, but used a then b: gradients arrive b first."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 4, bias=False)  # 32 elements
        self.a = nn.Linear(16, 8, bias=False)  # 128 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _collective_order() -> list:
    torch.manual_seed(0)
    ddp = DDP(OutOfOrder(), bucket_cap_mb=1e-6)  # a cap of one byte: one bucket per parameter
    x = torch.randn(4, 16)
    sequences = []
    for _ in range(3):
        with recording() as calls:
            ddp(x).sum().backward()
        sequences.append(calls)
    with recording() as calls:
        with ddp.no_sync():
            ddp(x).sum().backward()
    sequences.append(calls)
    return sequences


def test_one_all_reduce_per_bucket_in_order_then_rebuilt_order() -> None:
    for sequences in run_distributed(_collective_order, 2):
        first, second, third, local = sequences
        f32 = torch.float32
        # iteration 1: buckets in reverse registration order (a then b)
        assert first == [("all_reduce", 128, f32), ("all_reduce", 32, f32)]
        # before iteration 2: rank 0's ready order is broadcast, then buckets follow it (b then a)
        assert second == [("broadcast", 2, torch.int64), ("all_reduce", 32, f32), ("all_reduce", 128, f32)]
        assert third == [("all_reduce", 32, f32), ("all_reduce", 128, f32)]
        assert local == []


def _dtype_buckets_and_used_map() -> list:
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f32 = nn.Linear(16, 16)
            self.f64 = nn.Linear(16, 4).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.f64(self.f32(x).double())

    ddp = DDP(Mixed(), find_unused_parameters=True)
    with recording() as calls:
        ddp(torch.randn(2, 16)).sum().backward()
    return calls


def test_dtype_buckets_and_used_map_with_find_unused() -> None:
    for calls in run_distributed(_dtype_buckets_and_used_map, 2):
        # the fp64 head gets its gradients first; then the fp32 layer; then the used map
        assert calls == [
            ("all_reduce", 64 + 4, torch.float64),
            ("all_reduce", 256 + 16, torch.float32),
            ("all_reduce", 4, torch.int32),
        ]
