"""All buckets of one reducer: copying gradients in, and averaged results back out.

[Note: views that alias .grad]
With ``gradient_as_bucket_view=True`` a parameter's ``.grad`` *is* its bucket view, so
autograd accumulates straight into the flat bucket and no copy is needed. ``.grad``
may be replaced behind our back (``zero_grad(set_to_none=True)`` sets it to ``None``;
autograd then creates a fresh tensor): ``gather_grads`` notices by identity, copies
the fresh gradient in and points ``.grad`` back at the view.

[Note: delayed all-reduce]
``delay_all_reduce_named_params`` keeps the named parameters out of the regular buckets: they
get buckets of their own, placed in the launch order right after the bucket that holds
``param_to_hook_all_reduce`` (at the end if the hook parameter is itself delayed). Buckets launch
strictly in order, so the delayed ones start once the hook parameter's gradient *and* every
delayed gradient are ready, and backward waits for them like for any bucket. torch instead
starts them from a tensor hook on the hook parameter, whatever the delayed gradients' state,
and never waits (TORCH_DDP_NOTES §1j.4: silently unsynchronised gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..observability.timing import IterationTimes, now
from .autograd_context import ContextGradients
from .buckets import ParamInfo, assign_buckets
from .in_place import InPlaceGradients
from .results import check_result, failure_message, wait_for
from .storage import BucketStorage


class BucketSet:
    """The buckets of one assignment, and where each parameter lives in them."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        sparse: list[bool],
        order: Sequence[int],
        caps: list[int],
        reduce_lone_in_place: bool = False,
        delayed: frozenset[int] = frozenset(),
        reduce_dtype: torch.dtype | None = None,
        delay_after: int | None = None,
        pad_multiple: int = 1,
        hold_flats: bool = True,
    ) -> None:
        """``delayed``/``delay_after``: [Note: delayed all-reduce]; ``reduce_dtype``: the flat
        buffers' dtype when it is not the parameters' own (``mixed_precision``); ``pad_multiple``: flat
        buffers padded to a multiple of it (sharded reductions, engine/sharding.py); ``hold_flats``
        False: the flat buffers start released (a reduction that allocates each one while it sends it)."""
        self.params = params
        self.sparse = sparse
        self.caps = caps
        self.reduce_lone_in_place = reduce_lone_in_place
        self.delayed = delayed
        self.delay_after = delay_after
        self.reduce_dtype = reduce_dtype
        self.pad_multiple = pad_multiple
        self.hold_flats = hold_flats
        infos = [ParamInfo(p.numel() * p.element_size(), (p.device, p.dtype), s) for p, s in zip(params, sparse)]
        regular = [i for i in order if i not in delayed]
        self.order = regular  # with the caps, all it takes to build these buckets again elsewhere
        self.assignment = assign_buckets(infos, regular, caps, lone_oversized=reduce_lone_in_place)
        if delayed:  # one bucket per (device, dtype), whatever the cap: it is one collective by design
            position = len(self.assignment)
            if delay_after is not None and delay_after not in delayed:
                position = next(b for b, members in enumerate(self.assignment) if delay_after in members) + 1
            self.assignment[position:position] = assign_buckets(infos, sorted(delayed), [1 << 62])
        self.storages = [
            BucketStorage(
                indices,
                [params[i] for i in indices],
                sparse[indices[0]],
                reduce_lone_in_place,
                reduce_dtype,
                pad_multiple,
                hold_flats,
            )
            for indices in self.assignment
        ]
        self.bucket_of = [0] * len(params)
        self.slot_of = [0] * len(params)
        for b, indices in enumerate(self.assignment):
            for slot, i in enumerate(indices):
                self.bucket_of[i] = b
                self.slot_of[i] = slot
        self.device = params[0].device
        self._nbytes = sum(storage.nbytes for storage in self.storages)  # read every iteration
        self._backups: dict[int, torch.Tensor] = {}
        self.in_place = InPlaceGradients()  # [Note: reducing a lone gradient in place] in in_place.py
        # Set for a backward under distributed autograd: gradients are read from and written into
        # its context, never .grad ([Note: DDP under distributed autograd] in autograd_context.py).
        self.context: ContextGradients | None = None

    def rebuilt(
        self,
        order: Sequence[int],
        caps: list[int],
        as_view: bool,
        reduce_lone_in_place: bool,
        pad_multiple: int | None = None,
        hold_flats: bool | None = None,
    ) -> BucketSet:
        """A new assignment in ``order`` (padded as now unless ``pad_multiple`` says otherwise);
        bucket-view gradients move into the new buckets."""
        if not as_view or all(p.grad is None for p in self.params):
            # Nothing aliases the old flat buffers: free them before allocating the new ones,
            # so the rebuild does not hold two copies of every gradient at once.
            self.storages = []
        hold = self.hold_flats if hold_flats is None else hold_flats
        layout = (self.delayed, self.reduce_dtype, self.delay_after, pad_multiple or self.pad_multiple, hold)
        new = BucketSet(self.params, self.sparse, order, caps, reduce_lone_in_place, *layout)
        if as_view:
            for storage in new.storages:
                if storage.untouched:
                    continue  # its .grad is reduced where it is; the new buffer stays untouched
                for param, view in zip(storage.params, storage.views):
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view
        return new

    @property
    def nbytes(self) -> int:
        """Bytes of gradient one iteration reduces."""
        return self._nbytes

    def zeros_like_bucket(self, b: int) -> torch.Tensor:
        """What a rank without data contributes for bucket ``b``."""
        storage = self.storages[b]
        if not storage.sparse:  # not zeros_like(flat): that would give a lone bucket's flat buffer memory
            return torch.zeros(storage.numel, dtype=storage.dtype, device=storage.params[0].device)
        param = storage.params[0]
        indices = torch.empty((1, 0), dtype=torch.int64, device=param.device)
        return torch.sparse_coo_tensor(indices, param.new_empty((0, *param.shape[1:])), param.shape)

    def begin_iteration(self) -> None:
        self.in_place.clear()
        self._backups.clear()

    # ------------------------------------------------------------------ copy in
    def in_place_target(self, b: int, unused: set[int], names: list[str]) -> torch.Tensor | None:
        """The ``.grad`` to reduce bucket ``b`` in, if it can be.

        [Note: reducing a lone gradient in place] in in_place.py.
        """
        if self.context is not None:  # a dist backward's gradients live in its context, not .grad
            return None
        return self.in_place.target(b, self.storages[b], unused, names)

    def gather_grads(self, b: int, as_view: bool, unused: set[int], names: list[str], divisor: float = 1.0) -> None:
        """Put the current ``.grad`` of bucket ``b``'s parameters, divided by ``divisor``, into its flat buffer.

        [Note: one pass per gradient]
        Copy and division are one ``torch.div(grad, divisor, out=view)`` per parameter where the
        parameters are large: that reads and writes each gradient once instead of twice. For
        many small parameters the per-call cost outweighs a second pass, so those are copied by
        one ``_foreach_copy_`` and divided by one ``div_`` of the flat buffer.
        """
        storage = self.storages[b]
        if self.context is None:
            grads = [p.grad for p in storage.params]
        else:  # the context keeps its own tensors: copied in and out, never aliased
            grads, as_view = self.context.read(storage.params), False
        if self.in_place.buckets:  # a set's truth, not a call: this runs for every bucket
            self.in_place.check_not_in_flight(grads, storage.param_indices, names)
        divide = divisor != 1.0  # a one-rank group averages over itself: no pass at all
        # Fast paths, one call per bucket where possible. ``None in grads`` would compare
        # tensors with ==; identity is what we mean.
        if not unused and all(g is not None and not g.is_sparse for g in grads):
            if not as_view:
                _copy_in(storage, grads, divisor)  # type: ignore[arg-type]  # none is None: checked above
                return
            aliased = [g is v for g, v in zip(grads, storage.views)]
            if all(aliased):  # .grad kept from the last step: autograd accumulated in place
                if divide:
                    storage.flat.div_(divisor)
                return
            if not any(aliased):
                # Fresh tensors, e.g. after zero_grad(set_to_none=True): copy, then alias.
                _copy_in(storage, grads, divisor)  # type: ignore[arg-type]  # none is None: checked above
                for param, view in zip(storage.params, storage.views):
                    param.grad = view
                return
        in_place: list[torch.Tensor] = []  # gradients already in the bucket, still to divide
        for i, param, view, grad in zip(storage.param_indices, storage.params, storage.views, grads):
            if grad is not None and grad.is_sparse:
                raise RuntimeError(
                    f"Parameter '{names[i]}' produced a sparse gradient, but its module was not "
                    "declared sparse when wrapping (only nn.Embedding/EmbeddingBag(sparse=True) are)"
                )
            if grad is view:
                if i in unused:
                    # Reduction overwrites this .grad; keep it in case no rank used the parameter.
                    self._backups[i] = grad.clone()
                in_place.append(view)
                continue
            if grad is None:
                view.zero_()
                continue
            if divide:
                torch.div(grad, divisor, out=view)
            else:
                view.copy_(grad)
            if as_view and i not in unused:
                param.grad = view
        if divide and in_place:
            if len(in_place) == len(grads):
                storage.flat.div_(divisor)
            else:
                torch._foreach_div_(in_place, divisor)

    def sparse_grad(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s one sparse gradient, coalesced (empty where this rank has none)."""
        param = self.storages[b].params[0]
        grad = param.grad if self.context is None else self.context.read([param])[0]
        if grad is None:  # unused here: contribute an empty sparse gradient of the right shape
            grad = self.zeros_like_bucket(b)
        return grad.coalesce()

    # ------------------------------------------------------------------ copy out
    def write_back(
        self,
        results: list[Any],
        as_view: bool,
        globally_used: list[bool] | None,
        unused: set[int],
        hook_name: str | None,
        times: IterationTimes,
        after_bucket: Callable[[int], None] | None = None,
    ) -> list[str]:
        """Wait for every launched bucket in order and write the averages to ``.grad``.

        Each bucket is copied out as soon as it is waited for, while later ones are still in
        flight; ``after_bucket(b)`` then runs (a fused optimizer's step). Returns error messages
        (bad hook results, failed collectives); the caller raises.
        """
        errors: list[str] = []
        for b, pending in enumerate(results):
            if pending is None:
                continue
            try:
                result = wait_for(pending)
                times.bucket_done[b] = times.bucket_done[b] or now()
            except Exception as error:  # noqa: BLE001 - reported with the bucket named
                errors.append(failure_message(b, hook_name, error))
                continue
            problem = self._write_result(b, result, as_view, globally_used, unused, hook_name)
            if problem:
                errors.append(problem)
            elif after_bucket is not None:
                after_bucket(b)
        times.reductions_done = max(times.bucket_done, default=0.0) or now()
        self.begin_iteration()
        return errors

    def wait_all(
        self,
        results: list[Any],
        hook_name: str | None,
        times: IterationTimes,
        waiter: Callable[[Any], Any] | None = None,
    ) -> tuple[list[Any], str | None]:
        """Wait for every launched bucket, writing nothing: ``(values, failure)``.

        The fault-tolerant mode's first half of ``write_back``: ``.grad`` keeps the local gradient
        until the step is agreed on ([Note: a step is decided before it is written] in
        engine/tolerance.py). Stops at the first failed bucket, abandoning the rest.
        ``waiter(pending)`` replaces ``wait_for`` (the fault-tolerant mode waits in slices).
        """
        waiter = waiter or wait_for
        values: list[Any] = []
        for b, pending in enumerate(results):
            if pending is None:
                values.append(None)
                continue
            try:
                values.append(waiter(pending))
                times.bucket_done[b] = times.bucket_done[b] or now()
            except Exception as error:  # noqa: BLE001 - the caller decides what a failure means
                return values, failure_message(b, hook_name, error)
        times.reductions_done = max(times.bucket_done, default=0.0) or now()
        return values, None

    def write_all(
        self,
        results: list[Any],
        values: list[Any],
        as_view: bool,
        globally_used: list[bool] | None,
        unused: set[int],
        hook_name: str | None,
    ) -> list[str]:
        """The second half: write the values ``wait_all`` returned to ``.grad``."""
        errors = [
            problem
            for b, (pending, result) in enumerate(zip(results, values))
            if pending is not None
            and (problem := self._write_result(b, result, as_view, globally_used, unused, hook_name))
        ]
        self.begin_iteration()
        return errors

    def _write_result(
        self,
        b: int,
        result: Any,
        as_view: bool,
        globally_used: list[bool] | None,
        unused: set[int],
        hook_name: str | None,
    ) -> str | None:
        if b in self.in_place.buckets:
            return None  # the average is already in .grad
        storage = self.storages[b]
        if storage.sparse:
            index = storage.param_indices[0]
            if self.context is not None:
                self.context.write(storage.params, [result])
            elif globally_used is None or globally_used[index]:
                storage.params[0].grad = result
            return None
        storage.refresh_views_if_moved()
        if result is not None and result is not storage.flat:
            problem = check_result(b, result, storage.flat, hook_name)
            if problem:
                return problem
            storage.flat.copy_(result.view(-1))
        if self.context is not None:
            self._write_into_context(self.context, storage, globally_used)
            return None
        self._copy_out(storage, as_view, globally_used, unused)
        return None

    def _write_into_context(self, context: ContextGradients, storage: BucketStorage, used: list[bool] | None) -> None:
        """A dist backward's averages, into the context's own gradient tensors.

        Nothing public adds a gradient to a context, so a parameter this rank did not use but
        another did cannot get its average here: named, rather than left to step on one rank only.
        """
        missing = context.write(storage.params, storage.views)
        indices = storage.param_indices
        context.unplaced.extend(indices[k] for k in missing if used is not None and used[indices[k]])
        return None

    def _copy_out(self, storage: BucketStorage, as_view: bool, used: list[bool] | None, unused: set[int]) -> None:
        params, views = storage.params, storage.views
        if used is None and not unused and not as_view:
            grads = [p.grad for p in params]
            if all(g is not None for g in grads):
                torch._foreach_copy_(grads, views)  # type: ignore[arg-type]  # none is None: checked above
                return
        for i, param, view in zip(storage.param_indices, params, views):
            if used is not None and not used[i]:
                backup = self._backups.get(i)
                if backup is not None:
                    view.copy_(backup)
                continue
            grad = param.grad
            if as_view:
                if grad is not view:
                    param.grad = view
            elif grad is None:
                param.grad = view.clone()
            else:
                grad.copy_(view)


def _copy_in(storage: BucketStorage, grads: list[torch.Tensor], divisor: float) -> None:
    """Copy dense gradients into the bucket divided by ``divisor`` ([Note: one pass per gradient])."""
    if divisor != 1.0 and storage.fuse_division:
        for view, grad in zip(storage.views, grads):
            torch.div(grad, divisor, out=view)
        return
    torch._foreach_copy_(storage.views, grads)
    if divisor != 1.0:
        storage.flat.div_(divisor)
