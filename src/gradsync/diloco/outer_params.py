"""The layers of a model, and a fragment's parameters with its global copy as one flat tensor.

A *layer* is a module that holds parameters itself (``named_parameters(recurse=False)``), in
registration order: a ``Linear``, a ``LayerNorm``, a ``MultiheadAttention``'s input projection. A
parameter shared by two modules belongs to the first. Fragments are made of whole layers,
strided (fragments.py), or are what the user names ([Note: fragments the user names]).
Everything here runs at outer steps only: the inner step never sees a fragment.

[Note: fragments the user names]
``fragments=[m0, m1, ...]`` makes fragment ``p`` every parameter of ``m_p``: a submodule (a
transformer block, or several in an ``nn.ModuleList``), a parameter, or a list of those (a
parameter the root module holds itself, such as a learned position table, can only be named so),
as Streaming DiLoCo's fragments are groups of blocks and torchft takes them. Each parameter of
the model must be in exactly one of them (the embeddings and the final norm too): one left out
would never be synced, one in two would be stepped twice. Inside a fragment the parameters keep
the model's registration order, so the flat layout does not depend on how the user's modules nest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .fragments import strided


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

    def __init__(self, index: int, layers: list[Layer], home: torch.device | None = None, pin: bool = False) -> None:
        """``home``: where ``theta`` lives when not on the parameters' device (the host, pinned with ``pin``:
        [Note: the outer state off the GPU] in host_state.py)."""
        self.index = index
        self.names = [name for layer in layers for name, _ in layer.params]
        self.params = [param for layer in layers for _, param in layer.params]
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        # The global copy is kept in at least fp32: a bf16 model's outer steps then do not round to bf16.
        dtype = torch.float32
        for param in self.params:
            dtype = torch.promote_types(dtype, param.dtype)
        theta = self.local(dtype)
        if home is not None:
            theta = torch.empty(self.numel, dtype=dtype, device=home, pin_memory=pin).copy_(theta)
        self.theta = nn.Parameter(theta)

    def local(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The current local parameters, flat, in the global copy's dtype, on the parameters' device."""
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


def fragment_layers(module: nn.Module, fragments: int | Sequence[object]) -> list[list[Layer]]:
    """The layers of each fragment: strided for a count, the named submodules' parameters for a list."""
    layers = layers_of(module)
    if isinstance(fragments, int):
        return [[layers[i] for i in idx] for idx in strided(len(layers), fragments)]
    return [[layer] for layer in _named_fragments(module, fragments)]


def _named_fragments(module: nn.Module, fragments: Sequence[object]) -> list[Layer]:
    """One layer per fragment the user named ([Note: fragments the user names]), checked to partition the model."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    fragment_of: dict[int, int] = {}
    for p, group in enumerate(fragments):
        own = _parameters_of(group, p, rank)
        if not own:
            raise ValueError(f"fragments[{p}] ({type(group).__name__}) holds no parameters (rank {rank}).")
        strangers = [param for param in own if id(param) not in names]
        if strangers:
            raise ValueError(
                f"fragments[{p}] holds {len(strangers)} parameter(s) that are not the model's (rank {rank}), shapes "
                f"{[tuple(q.shape) for q in strangers][:4]}: name submodules of the model DiLoCo wraps."
            )
        for param in own:
            if fragment_of.setdefault(id(param), p) != p:
                raise ValueError(
                    f"Parameter {names[id(param)]} is in fragments[{fragment_of[id(param)]}] and fragments[{p}] "
                    f"(rank {rank}); every parameter must be in exactly one fragment."
                )
    missing = [name for key, name in names.items() if key not in fragment_of]
    if missing:
        raise ValueError(
            f"Parameters {missing[:8]}{' ...' if len(missing) > 8 else ''} are in none of the {len(fragments)} "
            f"fragments (rank {rank}): they would never be synced. Add the modules holding them (the embeddings, "
            "a final norm) to one of the fragments."
        )
    by_fragment: list[list[tuple[str, nn.Parameter]]] = [[] for _ in fragments]
    for name, param in module.named_parameters():  # the model's order inside each fragment
        by_fragment[fragment_of[id(param)]].append((name, param))
    return [Layer(f"fragments[{p}]", params) for p, params in enumerate(by_fragment)]


def _parameters_of(group: object, p: int, rank: int) -> list[nn.Parameter]:
    """A fragment's parameters: of a submodule, a parameter itself, or a list of those (deduplicated)."""
    parts = list(group) if isinstance(group, (list, tuple)) else [group]
    found: dict[int, nn.Parameter] = {}
    for part in parts:
        if isinstance(part, nn.Parameter):
            found.setdefault(id(part), part)
        elif isinstance(part, nn.Module):
            for param in part.parameters():
                found.setdefault(id(param), param)
        else:
            raise TypeError(
                f"fragments[{p}] holds a {type(part).__name__} (rank {rank}): each fragment is a submodule of the "
                "model, one of its parameters, or a list of those (e.g. [model.embed, model.position, block_0])."
            )
    return list(found.values())
