"""The optimizer the user named, over this rank's pieces: one tensor per piece, its state, its gradients.

A piece (engine/sharding.py) is the part of one parameter that falls in this rank's range of a
bucket. ``PieceOptimizer`` builds ``optimizer_class`` over one tensor per piece (a view of the
parameters' flat buffer, so a step writes the parameters), each in its parameter's param group,
and keeps which pieces lie in which bucket (``step_bucket``: [Note: the step inside backward] in
backward_step.py). A piece of a parameter that no param group holds gets a tensor but no group:
it is never stepped. State is keyed by piece between layouts (``state``, ``build``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ..engine.sharding import Piece
from .backward_step import step_pieces
from .elementwise import steps_in_parts
from .state_exchange import PieceState

GradOf = Callable[[Piece], "torch.Tensor | None"]  # a piece's gradient, or None: not stepped


class PieceOptimizer:
    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
        param_groups: list[dict[str, Any]],
        params: Sequence[torch.Tensor],
    ) -> None:
        """``param_groups``: the sharded optimizer's own (LR schedulers change them); ``params``: by engine index."""
        self.optimizer_class, self.kwargs = optimizer_class, kwargs
        self.param_groups, self.params = param_groups, params
        self.pieces: list[Piece] = []
        self.tensors: list[torch.Tensor] = []  # the inner optimizer's parameters: one view per piece
        self.group_of: list[int | None] = []  # per piece: its param group
        self.by_bucket: list[list[int]] = []  # per bucket: its pieces (indices)
        self.inner: torch.optim.Optimizer | None = None
        self.in_parts = steps_in_parts(optimizer_class)  # may be stepped bucket by bucket (step_in_order)

    def build(
        self, pieces: list[Piece], own_range: Callable[[int], torch.Tensor], buckets: int, state: PieceState
    ) -> None:
        """The inner optimizer over ``pieces`` (views of ``own_range(bucket)``), with their ``state``."""
        self.pieces = pieces
        self.tensors = [own_range(p.bucket).narrow(0, p.shard_start, p.length) for p in pieces]
        group = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        self.group_of = [group.get(id(self.params[piece.param])) for piece in pieces]
        inner_groups = [{**_values(g), "params": []} for g in self.param_groups]
        self.by_bucket = [[] for _ in range(buckets)]
        for i, (piece, tensor, g) in enumerate(zip(pieces, self.tensors, self.group_of)):
            self.by_bucket[piece.bucket].append(i)
            if g is not None:
                inner_groups[g]["params"].append(tensor)
        self.inner = self.optimizer_class(inner_groups, **self.kwargs)
        for piece, tensor in zip(pieces, self.tensors):
            if piece in state:
                self.inner.state[tensor] = state[piece]

    def release(self) -> None:
        """Let go of the views of the parameters' buffers (a relayout frees each old one as it moves)."""
        self.inner, self.tensors = None, []

    def state(self) -> PieceState:
        inner = cast(torch.optim.Optimizer, self.inner)  # built
        return {p: dict(inner.state[t]) for p, t in zip(self.pieces, self.tensors) if t in inner.state}

    def step(self, grad_of: GradOf) -> None:
        """Every piece with a gradient, with the param groups' hyper-parameters as they are now."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):  # type: ignore[union-attr]  # built
            inner.update(_values(outer))  # LR schedulers change the outer groups
        indices = range(len(self.pieces))
        self._bind(grad_of, indices)
        self.inner.step()  # type: ignore[union-attr]  # built
        self._unbind(indices)

    def step_in_order(self, order: list[int], grad_of: GradOf, after_bucket: Callable[[int], None]) -> None:
        """Every piece, then ``after_bucket(b)`` for each bucket in ``order``.

        [Note: gathers that leave as buckets are stepped]
        ``after_bucket`` starts a bucket's all-gather, which the next forward waits for in ``order``. An
        optimizer whose state is all per piece (``in_parts``) is stepped bucket by bucket in that order,
        each gather leaving as soon as its bucket is stepped: the first bucket the forward needs travels
        while the others are stepped, instead of all of them leaving after the whole step. On one link per
        rank (2 ranks, transformer) the forward's wait for gathers went from 15-16 to 4 ms, the step from 12
        to 17 ms (the gathers share its core); 0.954 vs 0.985 of gradsync DDP on the shared link, 1.049 vs
        1.044 (2 ranks) and 0.977 vs 0.996 (4) on one link per rank, same-day runs
        (benchmarks/results/2026-12-02-zero-speed-*step-by-bucket.md). Any other class may count its calls
        (``steps_in_parts``): one call, then the gathers.
        """
        if not self.in_parts:
            self.step(grad_of)
            for b in order:
                after_bucket(b)
            return
        hyperparameters: list[dict[str, Any]] | None = [_values(group) for group in self.param_groups]
        for b in order:
            self.step_bucket(b, grad_of, hyperparameters)
            hyperparameters = None  # the first bucket set them for this step
            after_bucket(b)

    def step_bucket(self, b: int, grad_of: GradOf, hyperparameters: list[dict[str, Any]] | None) -> None:
        """Bucket ``b``'s pieces alone; ``hyperparameters`` (per group) first, unless None (kept)."""
        for inner, values in zip(self.inner.param_groups, hyperparameters or []):  # type: ignore[union-attr]  # built
            inner.update(values)
        indices = self.by_bucket[b]
        self._bind(grad_of, indices)
        inner = cast(torch.optim.Optimizer, self.inner)  # built
        step_pieces(inner, [self.tensors[i] for i in indices], [self.group_of[i] for i in indices])
        self._unbind(indices)

    def _bind(self, grad_of: GradOf, indices: range | list[int]) -> None:
        for i in indices:
            self.tensors[i].grad = grad_of(self.pieces[i])

    def _unbind(self, indices: range | list[int]) -> None:
        for i in indices:
            self.tensors[i].grad = None


def _values(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}
