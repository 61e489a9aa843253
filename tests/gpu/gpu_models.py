"""Models and checks the GPU tests share: bitwise comparison with a local backward, slow branches on side streams."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import models  # tests/models.py: the CPU tests' models (tests/ is on sys.path, conftest.py)
from models import ConvBN

CUDA = torch.device("cuda", 0)
NO_CUDA = (
    "needs CUDA: torch.cuda.is_available() is False here; tests/gpu runs on a GPU machine (tests/gpu/run_on_device.sh)"
)
BRANCH_SLEEP_CYCLES = 100_000_000  # ~50-70 ms: a branch's backward much slower than the other's


class Delay(torch.autograd.Function):
    """Identity forward; backward sleeps on its stream first, so what follows it there is late."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(BRANCH_SLEEP_CYCLES)
        return grad * 1.0


class TwoBranches(nn.Module):
    """Two branches, each on a side stream of its own (the shape of DeepSpeed #8061), summed on the caller's.

    ``slow`` ("a" or "b") names the branch whose backward sleeps, so its gradients arrive late on its
    stream: a bucket launched from the other branch's stream without waiting for it reads them too early.
    Autograd runs the later branch (b) first on the host, so the bucket of all three layers completes in
    a's hook, on a's stream: with ``slow="b"`` a launch that does not wait for b's stream reads b's
    gradients before they are written; with ``slow="a"`` the launch is ordered after them anyway.
    """

    def __init__(self, slow: str, width: int = 64) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)
        self.slow = slow
        self.streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.streams is None:
            self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        caller = torch.cuda.current_stream()
        outputs = []
        for name, stream in zip("ab", self.streams):
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                h = torch.tanh(getattr(self, name)(x))
                # After the layer, so that in backward the sleep comes *before* its parameters' gradients.
                outputs.append(Delay.apply(h) if name == self.slow else h)
        for stream in self.streams:
            caller.wait_stream(stream)
        return self.head(outputs[0] + outputs[1])


def MLP() -> nn.Module:
    """tests/models.py's MLP, twice as wide: a few buckets' worth of gradients at small caps."""
    return models.MLP(width=32)


class SometimesUnused(nn.Module):
    """``unused`` never takes part; ``sometimes`` on odd steps only."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.unused = nn.Linear(width, width)
        self.sometimes = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, use_sometimes: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "conv_bn": ConvBN, "unused": SometimesUnused}


def batch(name: str, step: int, size: int = 8, device: torch.device = CUDA) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    shape = (size, 3, 8, 8) if name == "conv_bn" else (size, 64 if name == "two_branches" else 32)
    x = torch.randn(shape, generator=generator)
    y = torch.randn(size, 4, generator=generator)
    return x.to(device), y.to(device)


def model_and_reference(name: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = MODELS[name]().to(CUDA)
    return model, copy.deepcopy(model)


def forward_kwargs(name: str, step: int) -> dict[str, Any]:
    return {"use_sometimes": bool(step % 2)} if name == "unused" else {}


def assert_same_grads(model: nn.Module, reference: nn.Module, what: str, transform: Callable | None = None) -> None:
    """Bitwise: every ``.grad`` equals the reference's (after ``transform``, e.g. a rounding), None alike."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), f"{what}: {name} has a gradient, the local backward none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient, the local backward has one"
        expected = q.grad if transform is None else transform(q.grad)
        if not torch.equal(p.grad, expected):
            diff = (p.grad.float() - expected.float()).abs().max().item()
            raise AssertionError(f"{what}: {name}.grad differs from the local backward's (max |diff| {diff:.3g})")


def deterministic_kernels() -> None:
    """The same inputs give the same bits: cuDNN picks deterministic algorithms and does not benchmark."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Any operation that synchronises the host with the GPU inside the block raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
