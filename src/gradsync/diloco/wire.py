"""The wire formats of the outer exchange: how an fp32 piece of an outer gradient becomes bytes and back.

Every format is a pair of functions over flat tensors: ``encode`` turns ``n`` fp32 values into a
uint8 tensor of ``encoded_nbytes(n)`` bytes, ``decode`` turns those bytes back into ``n`` fp32
values. Byte tensors let one ``all_to_all_single`` carry any format.

[Note: decoding what was sent]
The exchange never uses a value that did not travel: the owner of a piece sums the *decoded*
contributions of every replica (its own included), and every replica, the owner too, takes the
*decoded* average the owner sent back. ``decode`` is a fixed function of the bytes, so every
replica holds the same bits afterwards, whatever the format's rounding. Sums are in fp32.

* ``fp32``: the bits as they are (4 bytes a value); lossless.
* ``bf16``: round to bfloat16 (2 bytes a value): 8 mantissa bits, fp32's range.
* ``int8``: per chunk of ``chunk`` values one fp32 scale ``s = max |x| / 127`` and the values as
  ``round(x / s)`` in -127..127 (1 byte a value, plus 4 bytes a chunk); a value is off by at most
  ``s / 2``. A chunk's scale is its own, so one large entry coarsens only its chunk.
* ``int4``: the same with ``s = max |x| / 7`` and values in -7..7, two to a byte (low nibble
  first, stored as ``q + 8``), over chunks of 256 (half a byte a value, plus 4 bytes a chunk: 1/7.75
  of fp32). Streaming DiLoCo sent 4-bit outer gradients; seven levels a side lose much more of each
  value than int8's 127, which is what ``error_feedback=True`` is for (error_feedback.py).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

LEVELS = 127  # int8 used symmetrically, so 0 is exact and the sign costs nothing
INT8_CHUNK = 1024  # values per int8 scale: 4 bytes of scale per 1024 of payload (0.4%)
INT4_LEVELS = 7  # -7..7: symmetric as int8's, one of the sixteen codes unused
# Values per int4 scale: 4 bytes per 128 of payload (3%); with only 7 levels a side, one large
# entry flattens the rest of its chunk to zero, so the chunks are kept smaller than int8's.
INT4_CHUNK = 256


class WireFormat(Protocol):
    name: str

    def encoded_nbytes(self, n: int) -> int: ...

    def encode(self, values: torch.Tensor) -> torch.Tensor: ...

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor: ...


class Fp32:
    name = "fp32"

    def encoded_nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float32).contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data.view(torch.float32).clone()


class Bf16:
    name = "bf16"

    def encoded_nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.bfloat16).view(torch.uint8)

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        return data.view(torch.bfloat16).to(torch.float32)


class Int8:
    """Layout: ``ceil(n / chunk)`` fp32 scales, then ``n`` int8 values."""

    name = "int8"

    def __init__(self, chunk: int = INT8_CHUNK) -> None:
        self.chunk = chunk

    def _chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def encoded_nbytes(self, n: int) -> int:
        return 4 * self._chunks(n) + n

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        n, k = values.numel(), self._chunks(values.numel())
        padded = torch.zeros(k * self.chunk, dtype=torch.float32)
        padded[:n] = values
        rows = padded.view(k, self.chunk)
        scale = rows.abs().amax(dim=1) / LEVELS
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk: no 0/0
        q = torch.round(rows / scale[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(-1)[:n].view(torch.uint8)])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        k = self._chunks(n)
        # A piece can start at any byte offset in the received buffer; copying the scales aligns them.
        scale = data[: 4 * k].clone().view(torch.float32)
        padded = torch.zeros(k * self.chunk, dtype=torch.float32)
        padded[:n] = data[4 * k : 4 * k + n].view(torch.int8)
        return (padded.view(k, self.chunk) * scale[:, None]).view(-1)[:n].clone()


class Int4:
    """Layout: ``ceil(n / chunk)`` fp32 scales, then ``ceil(n / 2)`` bytes of two 4-bit values each."""

    name = "int4"

    def __init__(self, chunk: int = INT4_CHUNK) -> None:
        self.chunk = chunk

    def _chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def encoded_nbytes(self, n: int) -> int:
        return 4 * self._chunks(n) + (n + 1) // 2

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        n, k = values.numel(), self._chunks(values.numel())
        padded = torch.zeros(k * self.chunk, dtype=torch.float32)
        padded[:n] = values
        rows = padded.view(k, self.chunk)
        scale = rows.abs().amax(dim=1) / INT4_LEVELS
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk: no 0/0
        q = torch.round(rows / scale[:, None]).clamp_(-INT4_LEVELS, INT4_LEVELS)
        codes = (q.view(-1)[:n] + 8).to(torch.uint8)  # 1..15; 8 is zero
        if n % 2:
            codes = torch.cat([codes, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = codes.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return torch.cat([scale.view(torch.uint8), packed])

    def decode(self, data: torch.Tensor, n: int) -> torch.Tensor:
        k = self._chunks(n)
        # A piece can start at any byte offset in the received buffer; copying the scales aligns them.
        scale = data[: 4 * k].clone().view(torch.float32)
        packed = data[4 * k : 4 * k + (n + 1) // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:n]
        padded = torch.zeros(k * self.chunk, dtype=torch.float32)
        padded[:n] = codes.to(torch.float32) - 8
        return (padded.view(k, self.chunk) * scale[:, None]).view(-1)[:n].clone()


def wire_format(wire: object) -> WireFormat:
    """The format named by ``DiLoCo(wire=...)``."""
    formats: dict[str, Callable[[], WireFormat]] = {"fp32": Fp32, "bf16": Bf16, "int8": Int8, "int4": Int4}
    if isinstance(wire, str) and wire in formats:
        return formats[wire]()
    if callable(wire):
        raise TypeError(
            f"wire takes 'fp32', 'bf16', 'int8' or 'int4', got the callable {getattr(wire, '__name__', wire)!r}. A "
            "comm hook (hook(state, bucket)) compresses gradients inside an island: register it on the island's "
            "DistributedDataParallel; the exchange across islands is compressed by wire='bf16', 'int8' or 'int4'."
        )
    raise ValueError(f"wire must be one of {sorted(formats)}, got {wire!r}.")
