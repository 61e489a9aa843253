"""The sweep's models: a grid of generated shapes, each a pure function of its parameters.

A shape is a frozen record of numbers (``GPTShape``, ``MLPShape``, ``ConvShape``); ``workload(shape)``
turns it into a ``Workload`` (lib/workloads.py) whose model, batches and loss depend on those numbers
and the seeds alone. The grid (``GRID``) was chosen to span compute per gradient byte over more than
two orders of magnitude on a CPU rank: from an MLP of few large layers at batch 4 (almost no compute
for many bytes) to the BatchNorm conv net at batch 32 (much compute for few bytes), with the
GPT-like decoders of a new user in between: few sequences per step, vocabularies up to 32k, tied and
untied heads. Gradients stay under ~30 MiB, so that one shape's rounds take well under a minute at
1 Gbit/s (a 2-rank all-reduce moves ~63 MB/s there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.lib.workloads import Batch, SmallResNet, TinyGPT, Workload, gpt_batch, gpt_loss

SEQ = 128  # tokens per sequence, every decoder


@dataclass(frozen=True)
class GPTShape:
    batch: int  # sequences per rank and step
    vocab: int
    width: int  # d_model; heads = width // 64
    layers: int
    tied: bool

    @property
    def name(self) -> str:
        head = "tied" if self.tied else "untied"
        return f"gpt_b{self.batch}_v{self.vocab // 1024}k_d{self.width}_L{self.layers}_{head}"

    def describe(self) -> str:
        return (
            f"GPT-like decoder: {self.layers} pre-norm layers, d_model {self.width}, {self.width // 64} heads, "
            f"vocab {self.vocab}, {'tied' if self.tied else 'untied'} head, seq {SEQ}, batch {self.batch}"
        )


@dataclass(frozen=True)
class MLPShape:
    layers: int
    width: int
    batch: int

    @property
    def name(self) -> str:
        return f"mlp_{self.layers}x{self.width}_b{self.batch}"

    def describe(self) -> str:
        return f"{self.layers} x (Linear({self.width}, {self.width}) + Tanh), batch {self.batch}, MSE loss"


@dataclass(frozen=True)
class ConvShape:
    width: int  # channel multiplier of SmallResNet's 16/32/64
    batch: int

    @property
    def name(self) -> str:
        return f"cnn_bn_w{self.width}_b{self.batch}"

    def describe(self) -> str:
        c = 16 * self.width
        return (
            f"ResNet-style CNN with BatchNorm (6 basic blocks, {c}/{2 * c}/{4 * c} channels), 32x32 RGB, "
            f"batch {self.batch}"
        )


Shape = GPTShape | MLPShape | ConvShape


def _mlp(shape: MLPShape) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(shape.width, shape.width), nn.Tanh()) for _ in range(shape.layers)])


def workload(shape: Shape, iters: int = 2, rounds: int = 5) -> Workload:
    """The shape as a workload: build() and make_batch() depend on the shape and the seeds only."""
    if isinstance(shape, GPTShape):
        s = shape

        def build() -> nn.Module:
            return TinyGPT(s.vocab, s.width, s.layers, heads=s.width // 64, seq=SEQ, tied=s.tied)

        def batch(g: torch.Generator) -> Batch:
            return gpt_batch(g, batch=s.batch, seq=SEQ, vocab=s.vocab)

        return Workload(s.name, s.describe(), build, batch, gpt_loss, iters=iters, rounds=rounds)
    if isinstance(shape, MLPShape):
        m = shape

        def mlp_batch(g: torch.Generator) -> Batch:
            return torch.randn(m.batch, m.width, generator=g), torch.randn(m.batch, m.width, generator=g)

        return Workload(m.name, m.describe(), lambda: _mlp(m), mlp_batch, F.mse_loss, iters=iters, rounds=rounds)
    c = shape

    def image_batch(g: torch.Generator) -> Batch:
        return torch.randn(c.batch, 3, 32, 32, generator=g), torch.randint(0, 10, (c.batch,), generator=g)

    return Workload(
        c.name,
        c.describe(),
        lambda: SmallResNet(width=c.width),
        image_batch,
        F.cross_entropy,
        iters=iters,
        rounds=rounds,
    )


K = 1024
GRID: tuple[Shape, ...] = (
    # Decoders with a big vocabulary and a narrow body: most bytes in the embedding, little compute.
    GPTShape(1, 32 * K, 128, 2, tied=True),
    GPTShape(4, 32 * K, 128, 2, tied=True),
    GPTShape(4, 32 * K, 128, 8, tied=True),
    GPTShape(2, 16 * K, 128, 2, tied=False),
    GPTShape(1, 16 * K, 128, 4, tied=True),
    GPTShape(4, 16 * K, 128, 4, tied=False),
    GPTShape(1, 8 * K, 256, 2, tied=True),
    GPTShape(2, 8 * K, 256, 2, tied=False),
    GPTShape(4, 8 * K, 256, 4, tied=True),
    GPTShape(2, 4 * K, 128, 4, tied=False),
    # The suite's transformer at 1, 2 and 4 sequences.
    GPTShape(1, 2 * K, 256, 4, tied=False),
    GPTShape(2, 2 * K, 256, 4, tied=False),
    GPTShape(4, 2 * K, 256, 4, tied=False),
    # Deep and narrow, and wide and shallow.
    GPTShape(1, 2 * K, 128, 8, tied=False),
    GPTShape(4, 2 * K, 128, 8, tied=True),
    GPTShape(2, 4 * K, 384, 2, tied=True),
    GPTShape(4, 2 * K, 384, 2, tied=False),
    GPTShape(1, 2 * K, 512, 2, tied=True),
    GPTShape(4, 2 * K, 512, 2, tied=True),
    # MLPs of many small layers (per-parameter overhead) and of few large ones (bytes, no compute).
    MLPShape(200, 64, 32),
    MLPShape(100, 128, 32),
    MLPShape(400, 32, 64),
    MLPShape(3, 1024, 4),
    MLPShape(2, 1536, 8),
    # The BatchNorm conv net: buffers broadcast before every forward, much compute per byte.
    ConvShape(1, 16),
    ConvShape(1, 32),
    ConvShape(2, 8),
)
