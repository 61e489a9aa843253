"""Flat gradient storage for one bucket: one flat tensor, and a view of it shaped like each parameter.

[Note: one allocation per bucket]
Every bucket owns a separate flat tensor rather than a slice of one big slab: hooks
may ``resize_`` or ``set_buffer`` the buffer, and a resize of a view into a shared
slab would silently overwrite the neighbouring bucket.
"""

from __future__ import annotations

import torch

FUSE_DIVISION_MIN_NUMEL = 1 << 15  # mean elements per gradient from which copy and division fuse


def _is_non_overlapping_and_dense(tensor: torch.Tensor) -> bool:
    """True when the strides are a permutation of a dense layout (e.g. channels_last)."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda item: item[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def make_view(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` shaped (and, when possible, strided) like ``param``.

    Matching the parameter's strides keeps the gradient layout contract, so a
    ``.grad`` that is a bucket view looks like one autograd would have produced.
    """
    if param.is_contiguous() or not _is_non_overlapping_and_dense(param):
        return flat.narrow(0, offset, param.numel()).view(param.shape)
    return flat.as_strided(param.shape, param.stride(), offset)


class BucketStorage:
    """One bucket's parameters, its flat buffer and per-parameter views into it."""

    __slots__ = (
        "param_indices",
        "params",
        "_flat",
        "_views",
        "_unallocated",
        "offsets",
        "sparse",
        "fuse_division",
        "untouched",
        "_data_ptr",
    )

    def __init__(
        self,
        param_indices: list[int],
        params: list[torch.Tensor],
        sparse: bool,
        lone_in_place: bool = False,
        dtype: torch.dtype | None = None,
        pad_multiple: int = 1,
        hold_flat: bool = True,
    ):
        """``lone_in_place``: a one-parameter dense bucket is normally reduced in that parameter's
        ``.grad`` (``untouched``), so its flat buffer gets memory only when a fallback first uses it
        (``flat`` or ``views``; every path writes the whole buffer before reading it): on CUDA an
        allocation is memory taken even if never written, and the lone bucket is the model's largest
        tensor (GPT-2's embedding: 0.14 GiB that gradsync's bucket views held beside the .grad, measured
        on an H200, benchmarks/results/2026-12-04-gpu-step-h200-stream-key.md).
        ``dtype``: the flat buffer's, when reductions run in another precision than the parameters'.
        ``pad_multiple``: the flat buffer is zero-padded to a multiple of it, so that it cuts into
        that many equal shards (a reduce-scatter over the group; engine/sharding.py).
        ``hold_flat`` False: the flat buffer starts released (``release``), for a reduction that
        allocates it only while it sends it."""
        dtype = dtype or params[0].dtype
        self.untouched = lone_in_place and not sparse and len(params) == 1 and dtype == params[0].dtype
        self.param_indices = param_indices
        self.params = params
        self.sparse = sparse
        self.offsets: list[int] = []
        total = 0
        for param in params:
            self.offsets.append(total)
            total += param.numel()
        self._unallocated = False  # True: the flat buffer has no memory until ``flat`` or ``views`` is used
        if sparse:
            # A sparse gradient cannot live in a dense flat buffer: it is reduced as it is.
            self._flat = torch.empty(0, dtype=dtype, device=params[0].device)
            self._views: list[torch.Tensor] = []
        else:
            allocate = torch.empty if self.untouched or not hold_flat else torch.zeros
            padded = -(-total // pad_multiple) * pad_multiple
            self._flat = allocate(padded, dtype=dtype, device=params[0].device)
            self._views = [make_view(self._flat, o, p) for o, p in zip(self.offsets, params)]
            if not hold_flat or self.untouched:  # views are made first: they check the bounds
                self._flat.untyped_storage().resize_(0)  # ``share`` (not held) or first use (untouched) gives memory
                self._unallocated = self.untouched
        self._data_ptr = self._flat.data_ptr()
        # See [Note: one pass per gradient] in bucket_set.py. benchmarks/studies/copy_in.py measured the
        # crossover at ~16K elements per gradient (one call each costs a second pass over that many).
        self.fuse_division = not sparse and total >= FUSE_DIVISION_MIN_NUMEL * len(params)

    @property
    def flat(self) -> torch.Tensor:
        """The bucket's flat buffer (given its memory here on first use, for an untouched lone bucket)."""
        if self._unallocated:
            self._allocate()
        return self._flat

    @property
    def views(self) -> list[torch.Tensor]:
        """One view of ``flat`` per parameter, shaped (and strided) like it."""
        if self._unallocated:
            self._allocate()
        return self._views

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included (known without allocating it)."""
        return self._flat.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self._flat.dtype

    @property
    def allocated(self) -> bool:
        """Whether the flat buffer holds memory (False for a lone bucket reduced in its .grad so far)."""
        return self._flat.untyped_storage().nbytes() > 0

    def _allocate(self) -> None:
        self._unallocated = False
        self._flat.untyped_storage().resize_(self._flat.numel() * self._flat.element_size())
        self._views = [make_view(self._flat, o, p) for o, p in zip(self.offsets, self.params)]
        self._data_ptr = self._flat.data_ptr()

    def refresh_views_if_moved(self) -> bool:
        """Re-point the views when a hook's ``resize_`` gave the flat buffer new storage."""
        if self.sparse or self.flat.data_ptr() == self._data_ptr:
            return False
        self._views = [make_view(self._flat, o, p) for o, p in zip(self.offsets, self.params)]
        self._data_ptr = self._flat.data_ptr()
        return True

    def share(self, buffer: torch.Tensor) -> None:
        """Keep the flat buffer in the front of ``buffer``, which other buckets use too (never at once).

        A sharded optimizer's ZeRO-2 holds one bucket at a time ([Note: buckets released as they
        drain] in reduce_scatter.py), so its buckets share one buffer; ``zero_padding`` before each use.
        """
        self._unallocated = False
        self._flat = buffer.narrow(0, 0, self._flat.numel())
        self._views = [make_view(self._flat, o, p) for o, p in zip(self.offsets, self.params)]
        self._data_ptr = self._flat.data_ptr()

    def zero_padding(self) -> None:
        """Zero the padding after the parameters' elements (a shared buffer's earlier user wrote there)."""
        numel = self.offsets[-1] + self.params[-1].numel()
        if numel < self.flat.numel():
            self.flat.narrow(0, numel, self.flat.numel() - numel).zero_()

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)
