"""Checking that every rank wraps the same model: names, shapes, dtypes and strides, compared with rank 0's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist


class ParamSignature(NamedTuple):
    """What every rank must agree on about one wrapped parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]


def signature_of(named_params: Sequence[tuple[str, torch.Tensor]]) -> list[ParamSignature]:
    return [ParamSignature(n, tuple(p.shape), str(p.dtype), tuple(p.stride())) for n, p in named_params]


def describe_mismatch(signatures: list[list[ParamSignature]]) -> str | None:
    """Compare every rank's parameter list with rank 0's; ``None`` when all agree."""
    reference = signatures[0]
    problems = []
    for rank, mine in enumerate(signatures[1:], start=1):
        for position, (ours, theirs) in enumerate(zip(reference, mine)):
            if ours != theirs:
                fields = [f for f in ParamSignature._fields if getattr(ours, f) != getattr(theirs, f)]
                detail = ", ".join(f"{f} {getattr(ours, f)} vs {getattr(theirs, f)}" for f in fields)
                problems.append(
                    f"parameter #{position} is '{ours.name}' on rank 0 but '{theirs.name}' on rank {rank} ({detail})"
                )
                break
        else:
            if len(reference) != len(mine):
                longer, rank_long = (reference, 0) if len(reference) > len(mine) else (mine, rank)
                extra = longer[min(len(reference), len(mine))].name
                problems.append(
                    f"rank 0 wraps {len(reference)} parameters but rank {rank} wraps {len(mine)} "
                    f"(first extra parameter on rank {rank_long}: '{extra}')"
                )
    if not problems:
        return None
    return "; ".join(problems)


def verify_same_parameters(named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup) -> None:
    """Raise on every rank if any rank wraps different parameters than rank 0."""
    mine = signature_of(named_params)
    gathered: list[list[ParamSignature] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    mismatch = describe_mismatch([g or [] for g in gathered])
    if mismatch is not None:
        raise RuntimeError(
            f"DDP expects same model across all ranks, but ranks wrap different models (seen on rank "
            f"{dist.get_rank(group)}): {mismatch}. Every rank must build the same model, with the "
            "same parameters in the same order, before wrapping it."
        )
