"""The bucket object comm hooks receive: torch's ``dist.GradBucket`` contract over gradsync's storage.

``GradBucket`` honours the contract of torch's ``dist.GradBucket`` (``index``, ``buffer``,
``set_buffer``, ``gradients``, ``parameters``, ``is_last``), so torch's built-in hooks run
unchanged; ``check_comm_hook`` rejects at registration what torch's DDP rejects.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .storage import BucketStorage, make_view


class GradBucket:
    """A bucket as a communication hook sees it (torch's ``dist.GradBucket`` contract).

    ``buffer()`` is the flat tensor of the bucket's gradients, not divided by the world
    size; ``gradients()`` are views into it shaped like ``parameters()``.
    """

    __slots__ = ("_index", "_buffer", "_storage", "_is_last")

    def __init__(self, index: int, buffer: torch.Tensor, storage: BucketStorage, is_last: bool):
        self._index = index
        self._buffer = buffer
        self._storage = storage
        self._is_last = is_last

    def index(self) -> int:
        """Position of this bucket in this iteration's launch order (changes at the rebuild)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor ``buffer()`` returns (e.g. by a compressed copy)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        if self._storage.sparse:
            return [self._buffer]
        if self._buffer is self._storage.flat:
            return list(self._storage.views)
        return [make_view(self._buffer, o, p) for o, p in zip(self._storage.offsets, self._storage.params)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._storage.params)

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, params={len(self._storage.params)})"


def check_comm_hook(hook: Callable[..., Any]) -> None:
    """Reject what torch's DDP rejects at registration: non-callables and wrong annotations."""
    if not callable(hook):
        raise TypeError(
            f"Communication hook must be callable. Got {type(hook).__name__}; pass a function "
            "hook(state, bucket) -> torch.futures.Future[torch.Tensor]."
        )
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    bucket = signature.parameters.get("bucket")
    if bucket is not None and bucket.annotation is not inspect.Parameter.empty:
        if "GradBucket" not in str(getattr(bucket.annotation, "__name__", bucket.annotation)):
            raise ValueError(
                "Communication hook: bucket annotation should be dist.GradBucket. "
                f"{hook.__qualname__} annotates 'bucket' as {bucket.annotation!r}."
            )
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and "Future" not in str(returned):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
            f"{hook.__qualname__} is annotated to return {returned!r}."
        )
