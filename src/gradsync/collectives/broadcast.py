"""Broadcasts of module state: many tensors in a few flat collectives, and small int lists.

Public ``torch.distributed`` calls only; every call goes through the given process group, so it
fails with that group's timeout instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def broadcast_int_list(values: list[int], src: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank gets ``src``'s list; all lists must have the same length."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=src, group=group)
    return tensor.tolist()
