"""Looking at forward outputs and the autograd graph behind them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: tensors, lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _is_owned_rref(obj):  # an RRef this process owns: what it holds (as torch's DDP does)
        yield from iter_tensors(obj.local_value())
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def _is_owned_rref(obj: Any) -> bool:
    rpc = getattr(torch.distributed, "rpc", None)
    rref = getattr(rpc, "RRef", None) if rpc is not None and rpc.is_available() else None
    return rref is not None and isinstance(obj, rref) and obj.is_owner()


def output_grad_fns(output: Any) -> list[torch.autograd.graph.Node]:
    """The distinct autograd nodes that produced the tensors in a forward's output."""
    nodes: dict[int, torch.autograd.graph.Node] = {}
    for tensor in iter_tensors(output):
        node = tensor.grad_fn
        if node is not None:
            nodes.setdefault(id(node), node)
    return list(nodes.values())


def reachable_leaves(roots: list[torch.autograd.graph.Node]) -> set[int]:
    """``id`` of every leaf tensor whose gradient-accumulation node is reachable from ``roots``."""
    seen: set[torch.autograd.graph.Node] = set()
    stack = list(roots)
    leaves: set[int] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if variable is not None:
            leaves.add(id(variable))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append(child)
    return leaves
