"""Small models and the single-process reference every parity test compares against."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)) + x)
        return self.head(x.mean(dim=(2, 3)))


class UnusedBranch(nn.Module):
    """``unused`` never takes part in forward; ``sometimes`` only when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


class MixedPrecision(nn.Module):
    """fp32 and fp64 parameters: they must land in separate buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.f32 = nn.Linear(16, 16)
        self.f64 = nn.Linear(16, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f64(torch.tanh(self.f32(x)).double()).float()


class SparseEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, sparse=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 100).long().remainder(50)[:, :3]
        return self.fc(self.embed(ids).mean(dim=1))


class Wide(nn.Module):
    """A gradient above gradsync's fused copy-and-divide threshold (see grad_bucket.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 8192)  # 131072 weights
        self.down = nn.Linear(8192, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class CheckpointedTwice(nn.Module):
    """The same layer checkpointed twice in one forward: its gradient arrives in two pieces."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.layer = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x))
        h = checkpoint(self.layer, h, use_reentrant=self.use_reentrant)
        h = checkpoint(self.layer, torch.tanh(h), use_reentrant=self.use_reentrant)
        return self.head(h)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn_bn": ConvBN,
    "unused_branch": UnusedBranch,
    "mixed_fp32_fp64": MixedPrecision,
    "sparse_embedding": SparseEmbed,
    "wide": Wide,
}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def global_batch(name: str, world_size: int, step: int, per_rank: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step; rank r trains on rows [r*per_rank, (r+1)*per_rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    n = per_rank * world_size
    shape = (n, 3, 8, 8) if name == "cnn_bn" else (n, 16)
    return torch.randn(shape, generator=generator), torch.randn(n, 4, generator=generator)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = t.shape[0] // world_size
    return t[rank * per_rank : (rank + 1) * per_rank]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def reference_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int) -> None:
    """Single-process gradients of the mean over shards of each shard's mean loss.

    For models without batch statistics this equals the mean loss over the concatenated
    batch; with BatchNorm each shard must be normalised on its own, as each rank does.
    """
    losses = [loss_fn(model(shard(x, r, world_size)), shard(y, r, world_size)) for r in range(world_size)]
    (sum(losses) / world_size).backward()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.to_dense() if g.is_sparse else g).clone()
    return out


def rank_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def assert_grads_close(actual: dict, expected: dict, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        a, e = actual[name], expected[name]
        if a is None or e is None:
            assert a is None and e is None, f"{name}: grad {a is None=} vs reference {e is None=}"
            continue
        assert torch.allclose(a, e, atol=atol, rtol=rtol), f"{name}: max diff {(a - e).abs().max().item()}"


def all_gather_flat(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's concatenation of ``tensors`` (for bitwise replica checks)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return gathered


def assert_replicas_identical(model: nn.Module, step: int) -> None:
    """Every rank holds the same parameters, bit for bit."""
    replicas = all_gather_flat(list(model.parameters()))
    assert all(torch.equal(replicas[0], r) for r in replicas), f"replicas differ after step {step}"


def assert_params_close(model: nn.Module, reference: nn.Module) -> None:
    """``model``'s parameters equal the single-process ``reference``'s to float tolerance."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-4), f"{name} differs from single-process training"
