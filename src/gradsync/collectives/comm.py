"""Collectives gradsync issues outside the gradient reduction itself.

Everything here uses public ``torch.distributed`` calls only; every call goes through
the given process group, so it fails with that group's timeout instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

# Broadcasts of module state are coalesced into flat buffers of at most this size, so a
# model with thousands of small tensors needs a handful of collectives, not thousands.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
# Each tensor starts at a multiple of this many bytes in a flat byte buffer, so a slice of
# it can be viewed as any dtype (``Tensor.view(dtype)`` needs an aligned storage offset).
_BYTE_ALIGNMENT = 16


def _chunks_by_device_and_size(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[list[torch.Tensor]]] = {}
    sizes: dict[torch.device, int] = {}
    for tensor in tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if tensor.device not in groups or sizes[tensor.device] + nbytes > cap_bytes:
            groups.setdefault(tensor.device, []).append([])
            sizes[tensor.device] = 0
        groups[tensor.device][-1].append(tensor)
        sizes[tensor.device] += nbytes
    return [chunk for chunks in groups.values() for chunk in chunks if chunk]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _BYTE_ALIGNMENT) * _BYTE_ALIGNMENT


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    src: int,
    group: dist.ProcessGroup,
    cap_bytes: int = BROADCAST_BUCKET_BYTES,
) -> None:
    """Broadcast ``tensors`` in place from global rank ``src``, one collective per flat chunk.

    A broadcast copies bits, so tensors of every dtype on one device share one flat byte
    buffer: a BatchNorm model's float statistics and int64 batch counters travel in one
    collective instead of one per dtype (torch's coalesced broadcast needs two).
    """
    if not tensors:
        return
    is_source = dist.get_rank() == src
    with torch.no_grad():
        for chunk in _chunks_by_device_and_size(tensors, cap_bytes):
            if len(chunk) == 1 and chunk[0].is_contiguous():
                dist.broadcast(chunk[0], src=src, group=group)
                continue
            offsets, total = [], 0
            for t in chunk:
                offsets.append(total)
                total += _aligned(t.numel() * t.element_size())
            flat = torch.empty(total, dtype=torch.uint8, device=chunk[0].device)
            slots = [
                flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, chunk)
            ]
            if is_source:
                torch._foreach_copy_(slots, chunk)
            dist.broadcast(flat, src=src, group=group)
            if not is_source:  # the source's tensors already hold these values
                torch._foreach_copy_(chunk, slots)


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


def broadcast_int_list(values: list[int], src: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank gets ``src``'s list; all lists must have the same length."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=src, group=group)
    return tensor.tolist()
