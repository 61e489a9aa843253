"""The benchmark workloads: a model, a synthetic batch and a loss, all from fixed seeds.

Shared by the studies (``iteration``, ``suite``, ``hooks``, ``ab``, ``elastic``, ...). Each workload
stresses one thing:

- ``mlp_many_small``: hundreds of tiny parameters, so per-parameter overhead (hooks,
  copies, Python) dominates, not bandwidth.
- ``cnn_bn``: convolutions with BatchNorm, so the buffer broadcast before every forward
  is part of what is timed.
- ``transformer``: a small GPT-style decoder, the shape most people train.
- ``large_grad``: tens of millions of parameters and almost no compute, so the time is
  the all-reduce's and the achieved bandwidth can be compared with a raw ``all_reduce``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    iters: int = 10  # iterations per contender per round: fewer for slow workloads
    rounds: int = 7
    momentum: float = 0.9  # SGD momentum; 0 saves a model-sized buffer on the big workloads


def gradient_size(workload: Workload) -> tuple[int, int, int]:
    """(parameter tensors, parameters, gradient bytes) of the workload's model."""
    params = list(workload.build().parameters())
    return len(params), sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


# ---------------------------------------------------------------------- models
def many_small_linears(layers: int = 200, width: int = 64) -> nn.Module:
    # Hundreds of tiny parameters: stresses per-parameter overhead (hooks, copies), not bandwidth.
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    return nn.Sequential(*blocks)


class BasicBlock(nn.Module):
    """ResNet's two-conv residual block; a strided 1x1 conv matches shapes when needed."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN for 32x32 images: 16 -> 32 -> 64 channels (``width`` times that), two blocks per stage."""

    def __init__(self, classes: int = 10, width: int = 1) -> None:
        super().__init__()
        c_in = 16 * width
        self.stem = nn.Sequential(nn.Conv2d(3, c_in, 3, padding=1, bias=False), nn.BatchNorm2d(c_in), nn.ReLU())
        stages = []
        for c_out, stride in ((16 * width, 1), (32 * width, 2), (64 * width, 2)):
            stages += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm causal blocks, LM head.

    ``tied``: the LM head shares the token embedding's weight (GPT-2's layout), so the vocabulary's
    gradient is one tensor, ready only after backward has gone through the whole model.
    """

    def __init__(
        self, vocab: int = 2048, d_model: int = 256, layers: int = 4, heads: int = 4, seq: int = 128, tied: bool = False
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tied:
            # GPT-2's init: with nn.Embedding's N(0, 1) the shared weight makes logits so large that the
            # softmax's gradients turn denormal, and CPU float math on denormals is ~10x slower.
            nn.init.normal_(self.tokens.weight, std=0.02)
            self.head.weight = self.tokens.weight
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(positions)
        x = self.blocks(x, mask=self.causal, is_causal=True)
        return self.head(self.norm(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(g: torch.Generator, batch: int = 4, seq: int = 128, vocab: int = 2048) -> Batch:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def huge_linears(layers: int = 3, width: int = 4096) -> nn.Module:
    # ~50 M parameters (200 MiB of fp32 gradients) and a batch of 4: communication-bound.
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


# ---------------------------------------------------------------------- the registry
WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "mlp_many_small",
            "200 x (Linear(64, 64) + Tanh), batch 32, MSE loss",
            many_small_linears,
            lambda g: (torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)),
            F.mse_loss,
        ),
        Workload(
            "cnn_bn",
            "ResNet-style CNN with BatchNorm (6 basic blocks, 16/32/64 channels), 32x32 RGB, batch 16",
            SmallResNet,
            lambda g: (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)),
            F.cross_entropy,
        ),
        Workload(
            "transformer",
            "GPT-style decoder: 4 pre-norm layers, d_model 256, 4 heads, vocab 2048, seq 128, batch 4",
            TinyGPT,
            gpt_batch,
            gpt_loss,
            iters=4,
        ),
        Workload(
            "large_grad",
            "3 x Linear(4096, 4096), batch 4, MSE loss, SGD without momentum",
            huge_linears,
            lambda g: (torch.randn(4, 4096, generator=g), torch.randn(4, 4096, generator=g)),
            F.mse_loss,
            iters=3,
            rounds=5,
            momentum=0.0,
        ),
    )
}
