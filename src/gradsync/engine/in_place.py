"""Reducing a lone gradient where it is: which ``.grad`` tensors are being averaged in place.

[Note: reducing a lone gradient in place]
Without a comm hook, a bucket that holds a single dense parameter (``lone_oversized`` in
buckets.py puts every parameter at least as large as its cap in one) is all-reduced
directly in that parameter's ``.grad``: divided in place, summed in place, nothing copied
in or out. Without bucket views the user sees what the copying path gives: the same
``.grad`` tensor, holding the average. With bucket views, ``.grad`` is then the tensor the
all-reduce ran in rather than a view of a separate buffer; for a one-parameter bucket
that is the same thing (the gradient *is* the bucket), and it is what bucket views are for:
no copy and no second copy of the gradient in memory. The flat buffer of such a bucket
gets its memory only when first used (``BucketStorage.flat``): it serves only the
iterations where the gradient cannot be used directly: no gradient on this rank, a
gradient that is sparse, non-contiguous or part of a graph (``create_graph=True``), or a
parameter that has post-accumulate-grad hooks of someone else (they may read ``.grad``).
"""

from __future__ import annotations

import torch

from .storage import BucketStorage


class InPlaceGradients:
    """The buckets of one iteration reduced in their parameter's ``.grad``, and those tensors.

    A gradient in flight must not be read or reduced a second time: two parameters sharing one
    ``.grad`` tensor would otherwise be averaged twice, silently. Cleared at every iteration's start.
    """

    def __init__(self) -> None:
        self.buckets: set[int] = set()  # reduced in their parameter's .grad this iteration (empty: none in flight)
        self._owner_of: dict[int, int] = {}  # data_ptr of each such .grad -> its parameter's index

    def clear(self) -> None:
        self.buckets.clear()
        self._owner_of.clear()

    def target(self, b: int, storage: BucketStorage, unused: set[int], names: list[str]) -> torch.Tensor | None:
        """The ``.grad`` to reduce bucket ``b`` in, if it can be (the note); recorded as in flight."""
        if not storage.untouched:
            return None
        param = storage.params[0]
        grad = param.grad
        index = storage.param_indices[0]
        if (
            grad is None
            or index in unused
            or grad.is_sparse
            or grad.requires_grad
            or not grad.is_contiguous()
            or _has_other_post_accumulate_hooks(param)
        ):
            return None
        self.check_not_in_flight([grad], [index], names)
        self.buckets.add(b)
        self._owner_of[grad.data_ptr()] = index
        return grad

    def check_not_in_flight(self, grads: list[torch.Tensor | None], indices: list[int], names: list[str]) -> None:
        """Raise if one of ``grads`` (of the parameters ``indices``) is being averaged in place."""
        for grad, index in zip(grads, indices):
            owner = None if grad is None else self._owner_of.get(grad.data_ptr())
            if owner is not None:
                raise RuntimeError(
                    f"Parameters '{names[owner]}' and '{names[index]}' share one .grad tensor, which is "
                    "being averaged in place; a gradient shared between parameters cannot be averaged "
                    "for each of them. Give every parameter its own .grad (e.g. zero_grad(set_to_none=True))."
                )


def _has_other_post_accumulate_hooks(param: torch.Tensor) -> bool:
    """Whether someone besides gradsync hooks this parameter after accumulation.

    Such a hook may run after ours and read ``.grad``; with the copying path it sees the local
    gradient (as with torch's DDP), with an in-place reduction it would see one in flight.
    torch keeps these hooks in ``_post_accumulate_grad_hooks``; if that ever moves, we count
    none and keep reducing in place.
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return hooks is not None and len(hooks) > 1  # ours is one of them
