"""Soak: thousands of iterations on 2 ranks, and the resident memory must stay flat.

A reducer that keeps something per iteration (a future, a bucket copy, a graph through a
saved tensor, an ever-growing history) passes every parity test and still runs a long job
out of memory. Each configuration trains a small model for ``ITERATIONS`` steps; after
``WARMUP`` steps (buckets rebuilt, allocator pools filled) every rank samples its
``VmRSS`` each ``SAMPLE_EVERY`` steps, and no sample may exceed the first by more than
``BOUND_MB``.

What the bound catches, measured by leaking on purpose in a scratch run: keeping one
weight's gradient (16 kB) per iteration grows RSS by ~50 MB, keeping one 2 kB tensor by
~8 MB; both fail. A few hundred bytes of Python objects per iteration (~1 MB) stay under
the bound: the allocator's own drift after warm-up is up to ~1 MB here.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsync import DistributedDataParallel as DDP
from gradsync.hooks import PowerSGDState, powersgd_hook

from harness import run_distributed

ITERATIONS = 3000
WARMUP = 300
SAMPLE_EVERY = 300
BOUND_MB = 4.0
WIDTH = 64


class Net(nn.Module):
    """Four hidden layers; ``sometimes`` takes part only on even iterations (for find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        h = self.hidden(x)
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


CONFIGS = {
    "default": {},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "find_unused_parameters": {"find_unused_parameters": True},
    "powersgd_hook": {},
}


def rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def _soak(config: str) -> list[int]:
    """Train ``ITERATIONS`` steps under ``config``; this rank's RSS samples (kB) after warm-up."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    ddp = DDP(Net(), **CONFIGS[config])
    if config == "powersgd_hook":
        # Compressing from iteration 10 on: the error-feedback and warm-start memories are live.
        ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=2, start_iter=10), powersgd_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, WIDTH, generator=generator), torch.randn(8, 4, generator=generator)
    skip_sometimes = config == "find_unused_parameters"
    samples = []
    with warnings.catch_warnings():
        # gradsync warns (as torch does) when find_unused_parameters finds nothing unused.
        warnings.filterwarnings("ignore", message="find_unused_parameters=True but every parameter")
        for step in range(1, ITERATIONS + 1):
            optimizer.zero_grad()
            output = ddp(x, use_sometimes=not skip_sometimes or step % 2 == 0)
            F.mse_loss(output, y).backward()
            optimizer.step()
            if step >= WARMUP and (step - WARMUP) % SAMPLE_EVERY == 0:
                gc.collect()
                samples.append(rss_kb())
    return samples


@pytest.mark.timeout(90)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_memory_stays_flat_over_thousands_of_iterations(config: str) -> None:
    for rank, samples in enumerate(run_distributed(_soak, 2, config, timeout_s=80)):
        growth_mb = (max(samples) - samples[0]) / 1024
        assert growth_mb < BOUND_MB, (
            f"{config}: rank {rank}'s RSS grew by {growth_mb:.1f} MB over {ITERATIONS - WARMUP} iterations after "
            f"warm-up (samples in kB every {SAMPLE_EVERY} iterations: {samples})"
        )
