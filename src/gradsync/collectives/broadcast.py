"""Broadcasts of module state: many tensors in a few flat collectives, and small int lists.

Public ``torch.distributed`` calls only; every call goes through the given process group, so it
fails with that group's timeout instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

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
    if tensors:
        _broadcast(_lay_out(tensors, cap_bytes), src, group)


class StandingBroadcast:
    """[Note: a broadcast that keeps its flat buffers]
    The same tensors broadcast again and again: a module's buffers before every forward. Laid out
    anew on each call, a flat buffer costs an allocation and three view operators per tensor; a
    BatchNorm network has three buffers per layer, and under a Python dispatch mode (a sharded
    optimizer's guard over parameters still being gathered, zero/stale_guard.py) every operator
    is a Python call: on the benchmarks' cnn_bn (15 BatchNorm layers, 45 buffers) that broadcast
    took 5.6 ms of a 30 ms forward, against 0.6 ms without the mode. So the flat buffers and each
    tensor's view of them are made once and kept while the tensors keep their dtypes, shapes and
    contiguity (checked on every call); a call is then a copy in (the source), the collective and a copy out
    (the others) per flat buffer: 5 operators there instead of 34 for 7 buffers. Layouts over
    ``KEEP_BYTES`` are not kept (large buffers would be held twice): those are laid out per call.
    """

    KEEP_BYTES = 64 * 1024 * 1024

    def __init__(self, tensors: Sequence[torch.Tensor], cap_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
        self.tensors = list(tensors)
        self.cap_bytes = cap_bytes
        self._kept: tuple[list[Any], list[_Chunk]] | None = None  # (the tensors' signature, their layout)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled wrapper (torch's DDP pickles too) carries no copy of its buffers: the layout is made again.
        return {**self.__dict__, "_kept": None}

    def __call__(self, src: int, group: dist.ProcessGroup) -> None:
        """Broadcast the tensors in place from global rank ``src``."""
        if not self.tensors:
            return
        signature = [(t.dtype, t.shape, t.device, t.is_contiguous()) for t in self.tensors]
        if self._kept is not None and self._kept[0] == signature:
            chunks = self._kept[1]
        else:
            chunks = _lay_out(self.tensors, self.cap_bytes)
            kept = sum(chunk.flat.numel() for chunk in chunks if chunk.flat is not None) <= self.KEEP_BYTES
            self._kept = (signature, chunks) if kept else None
        try:
            _broadcast(chunks, src, group)
        except BaseException:
            self._kept = None  # a failed collective may still write into its buffer: never reuse it
            raise


class _Chunk(NamedTuple):
    """Tensors broadcast in one collective: through ``flat`` (each tensor's ``slots`` view of it), or
    alone when ``flat`` is None (one contiguous tensor)."""

    tensors: list[torch.Tensor]
    flat: torch.Tensor | None
    slots: list[torch.Tensor]


def _lay_out(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[_Chunk]:
    chunks = []
    for chunk in _chunks_by_device_and_size(tensors, cap_bytes):
        if len(chunk) == 1 and chunk[0].is_contiguous():
            chunks.append(_Chunk(chunk, None, []))
            continue
        offsets, total = [], 0
        for t in chunk:
            offsets.append(total)
            total += _aligned(t.numel() * t.element_size())
        flat = torch.empty(total, dtype=torch.uint8, device=chunk[0].device)
        slots = [flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, chunk)]
        chunks.append(_Chunk(chunk, flat, slots))
    return chunks


def _broadcast(chunks: list[_Chunk], src: int, group: dist.ProcessGroup) -> None:
    is_source = dist.get_rank() == src
    with torch.no_grad():
        for chunk in chunks:
            if chunk.flat is None:  # one tensor, contiguous when laid out (the signature holds that)
                dist.broadcast(chunk.tensors[0], src=src, group=group)
                continue
            if is_source:
                torch._foreach_copy_(chunk.slots, chunk.tensors)
            dist.broadcast(chunk.flat, src=src, group=group)
            if not is_source:  # the source's tensors already hold these values
                torch._foreach_copy_(chunk.tensors, chunk.slots)


def broadcast_int_list(values: list[int], src: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank gets ``src``'s list; all lists must have the same length."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=src, group=group)
    return tensor.tolist()
