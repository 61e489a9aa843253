"""Starting one bucket's reduction: gradients in, collective (or comm hook) out.

The reducer decides *when* a bucket starts ([Note: launch order] in reducer.py); this
module is *how*: pick the gradient to reduce in place or gather the bucket, divide, and
start the all-reduce or call the comm hook. Errors are returned as messages rather than
raised, so a failing rank still issues every collective and the others do not hang; the
reducer raises them at the end of backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..observability.desync import Position
from ..observability.labels import label
from ..observability.timing import now
from .bucket_set import BucketSet
from .errors import add_note, hook_not_future
from .grad_bucket import GradBucket

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


def hook_name(hook: CommHook) -> str:
    """How messages name a comm hook."""
    return getattr(hook, "__qualname__", None) or repr(hook)


def start_dense(
    buckets: BucketSet,
    b: int,
    divisor: float,
    unused: set[int],
    names: list[str],
    as_view: bool,
    group: dist.ProcessGroup,
    hook: CommHook | None,
    hook_state: Any,
    rank: int,
    iteration: int,
) -> tuple[Any, list[str | Exception]]:
    """Start dense bucket ``b``: ``(pending, errors)``; pending is a work handle, a hook's
    future, or None when the start itself failed. An exception a comm hook raised comes back as
    itself (with a note saying where), so backward() re-raises the hook's own exception type.

    Without a hook the gradients are divided before summing, so low-precision gradients cannot
    overflow; a hook receives them undivided, as torch's hooks expect (``divisor`` is then 1).
    """
    where = f"rank {rank}, iteration {iteration}"
    errors: list[str | Exception] = []
    storage = buckets.storages[b]
    target = None
    if hook is None:
        try:
            target = buckets.in_place_target(b, unused, names)
        except RuntimeError as error:
            errors.append(f"{error} ({where})")
    if target is not None:
        if divisor != 1.0:
            target.div_(divisor)
    else:
        try:
            buckets.gather_grads(b, as_view, unused, names, divisor)
        except (RuntimeError, ValueError) as error:
            errors.append(f"{error} ({where})")
        target = storage.flat
    if hook is None:
        try:
            return dist.all_reduce(target, group=group, async_op=True), errors
        except RuntimeError as error:  # a dead peer can fail the launch itself
            return None, [*errors, f"all-reduce failed on bucket {b}: {error}"]
    bucket = GradBucket(b, storage.flat, storage, is_last=b == len(buckets.storages) - 1)
    try:
        result = hook(hook_state, bucket)
    except Exception as error:  # noqa: BLE001 - re-raised from backward() once every bucket was launched
        add_note(error, f"gradsync: raised by comm hook {hook_name(hook)} on bucket {b} ({where})")
        return None, [*errors, error]
    if not isinstance(result, torch._C.Future):  # torch.futures.Future and what .get_future() returns
        return None, [*errors, RuntimeError(hook_not_future(hook_name(hook), result, b, rank, iteration))]
    return result, errors


def start_sparse(
    buckets: BucketSet,
    b: int,
    take_divisor: Callable[[], float],
    group: dist.ProcessGroup,
    hook: CommHook | None,
    hook_state: Any,
) -> Any:
    """Start sparse bucket ``b`` (one parameter, reduced as the sparse tensor it is)."""
    grad = buckets.storages[b].params[0].grad
    if grad is None:  # unused here: contribute an empty sparse gradient of the right shape
        grad = buckets.zeros_like_bucket(b)
    grad = grad.coalesce()
    if hook is None:
        grad = grad / take_divisor()
        return dist.all_reduce(grad, group=group, async_op=True).get_future()
    bucket = GradBucket(b, grad, buckets.storages[b], is_last=b == len(buckets.storages) - 1)
    return hook(hook_state, bucket)


def finish_hook_launches(hook_state: Any) -> None:
    """Tell a comm hook that no bucket follows in this pass (every one was launched or skipped).

    A hook may leave part of a bucket's work for its next call (gradsync's PowerSGD does:
    [Note: P in flight] in hooks/low_rank.py); its state's ``finish_launches`` does that work
    now. Other states (torch's included, and ``None`` without a hook) have no such method and
    nothing happens.
    """
    finish = getattr(hook_state, "finish_launches", None)
    if callable(finish):
        finish()


class LaunchesBuckets:
    """Mixed into ``Reducer``: starting bucket ``b`` once it is its turn ([Note: launch order])."""

    def _launch(self: Any, b: int) -> None:
        with label("gradsync::reduce_bucket"):
            self.times.bucket_launch[b] = now()
            storage = self.buckets.storages[b]
            if self.failures:
                self._results.append(None)  # fault-tolerant mode: this step failed, start nothing more
                return
            if self.desync is not None:
                what = f"all-reduce of bucket {b}"
                self.desync.check(Position(what, self.synced_forwards, storage.flat.numel(), str(storage.flat.dtype)))
            if self.skip_unused and self._known_unused and self._known_unused.issuperset(storage.param_indices):
                self._results.append(None)  # skip_all_reduce_unused_params: no collective, .grad untouched
            elif storage.sparse:
                sparse = start_sparse(
                    self.buckets, b, self._take_divisor, self.process_group, self.comm_hook, self.comm_hook_state
                )
                self._results.append(sparse)
            else:
                self._launch_dense(b)
            if self.timeline is not None and self._results[-1] is not None:
                self._record_completion(b, self._results[-1])

    def _record_completion(self: Any, b: int, pending: Any) -> None:
        future = pending.get_future() if isinstance(pending, dist.Work) else pending
        times = self.times

        def done(_: Any) -> None:
            times.bucket_done[b] = now()

        future.add_done_callback(done)

    def _launch_dense(self: Any, b: int) -> None:
        divisor = self._take_divisor() if self.comm_hook is None else 1.0
        pending, problems = start_dense(
            self.buckets,
            b,
            divisor,
            self._marked_unused,
            self.names,
            self.as_view,
            self.process_group,
            self.comm_hook,
            self.comm_hook_state,
            self.rank,
            self.iteration,
        )
        self._results.append(pending)
        self._errors.extend(problems)
