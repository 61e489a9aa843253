"""The layers of a model, and a fragment's parameters with its global copy as one flat tensor.

A *layer* is a module that holds parameters itself (``named_parameters(recurse=False)``), in
registration order: a ``Linear``, a ``LayerNorm``, a ``MultiheadAttention``'s input projection. A
parameter shared by two modules belongs to the first. Fragments are made of whole layers
(fragments.py). Everything here runs at outer steps only: the inner step never sees a fragment.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Layer(NamedTuple):
    name: str
    params: list[tuple[str, nn.Parameter]]


def layers_of(module: nn.Module) -> list[Layer]:
    seen: set[int] = set()
    layers = []
    for prefix, child in module.named_modules():
        own = []
        for name, param in child.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                own.append((f"{prefix}.{name}" if prefix else name, param))
        if own:
            layers.append(Layer(prefix, own))
    return layers


class Fragment:
    """Some layers' parameters, the flat global copy of them (``theta``) the outer optimizer steps,
    and how to move values between the two."""

    def __init__(self, index: int, layers: list[Layer]) -> None:
        self.index = index
        self.names = [name for layer in layers for name, _ in layer.params]
        self.params = [param for layer in layers for _, param in layer.params]
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        # The global copy is kept in at least fp32: a bf16 model's outer steps then do not round to bf16.
        dtype = torch.float32
        for param in self.params:
            dtype = torch.promote_types(dtype, param.dtype)
        self.theta = nn.Parameter(self.local(dtype))

    def local(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The current local parameters, flat, in the global copy's dtype."""
        dtype = dtype or self.theta.dtype
        return torch.cat([p.detach().reshape(-1).to(dtype) for p in self.params])

    def outer_gradient(self) -> torch.Tensor:
        """``theta_global - theta_local``: old global minus new local, so a descent step moves toward local."""
        return self.theta.detach() - self.local()

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        for param, values in zip(self.params, flat.split(self.sizes)):
            param.copy_(values.view_as(param))

    @torch.no_grad()
    def mix(self, alpha: float) -> None:
        """``theta_local <- alpha * theta_local + (1 - alpha) * theta_global`` (Streaming DiLoCo's merge)."""
        self.write(torch.lerp(self.theta.detach(), self.local(), alpha))

    @torch.no_grad()
    def keep_inner_steps(self, sent: torch.Tensor, before: torch.Tensor) -> None:
        """``theta_local <- theta_global + (theta_local - theta_local_at_start)``: the new global copy plus the
        inner steps taken while the exchange was in flight ([Note: the merge that keeps the inner steps]).

        ``sent`` is this replica's outer gradient as it started, ``before`` the global copy it was taken
        from: ``before - sent`` is the local fragment when the exchange started.
        """
        at_start = before - sent
        self.write(self.theta.detach() + (self.local() - at_start))
