"""Denormal numbers flushed to zero while a compressing hook computes, on the CPU.

[Note: denormals in a low-rank round]
A gradient that has all but vanished (deep tanh MLPs: 6-14% of their gradient entries below fp32's
smallest normal number, 1.2e-38) makes every product and sum that meets it take the x86 slow path:
dividing and summing 832 k such floats took 22 ms against 0.75 (docs/performance.md, "Denormal gradients"). PowerSGD's
round reads such a gradient several times (the working matrix, ``M Q``, ``M^T P``, the residual, the
output), and makes more of them: the warm-start ``Q`` has the gradient's magnitude, so ``P = M Q`` has its
square, which underflows for a gradient of 1e-19 or less. At rank 4, world size 1, on the AVX512 machine:
``mlp_200x64_b32`` (14% denormal) took 43 ms of backward with the hook where the bare module took 33, and
40 flushed; ``mlp_100x128_b32`` (no denormal gradient, but tiny ones) 21 ms where the bare module took 5,
and 13.5 flushed. Values that small cannot move a weight (a step of 1e-38 is lost next to any weight
above 1e-31), so the round computes with them flushed: inside ``flushed_denormals()`` this thread reads
denormal operands as zero and writes zero for a denormal result (``torch.set_flush_denormal``), and the
thread's own setting comes back afterwards. Only the round's arithmetic is affected; gradients sent
uncompressed in ``P``'s all-reduce lose their denormal entries too (they are summed as zero).

Every rank must write the same bits, so every piece of the round runs flushed, wherever it runs: the
hook's call, the reducer's ``finish_launches``, and the write of the output, which is a future's
callback and may run on a gloo thread (whose setting is its own). torch reads no global flag for this:
the setting is the calling thread's, and torch has no getter, so a probe (3 us) reads it.
GPU tensors are untouched: this is the CPU's floating-point mode only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def flushing_denormals() -> bool:
    """Whether this thread flushes denormal numbers now: 1e-40 stored as fp32 reads back as zero."""
    return torch.tensor(1e-40).item() == 0.0


@contextlib.contextmanager
def flushed_denormals(device: torch.device) -> Iterator[None]:
    """Within the block this thread flushes denormal numbers on the CPU; its own setting is restored after."""
    if device.type != "cpu" or flushing_denormals():
        yield
        return
    switched = torch.set_flush_denormal(True)  # False where the CPU has no such mode: nothing to restore
    try:
        yield
    finally:
        if switched:
            torch.set_flush_denormal(False)
