"""How one bucket is averaged across the group: the reducer holds one ``Reduction``.

The reducer decides *when* a bucket starts ([Note: launch order] in reducer.py); a reduction is
*how*: gather the bucket's gradients (or pick the one ``.grad`` to reduce in place), start the
collective or call the comm hook, and at the end of backward write the results to ``.grad``.

- ``AllReduce``: the default. Divides before summing, so low-precision gradients cannot
  overflow, and reduces a lone large gradient in its own ``.grad``.
- ``CommHookReduction``: ``register_comm_hook(state, hook)``. The hook receives the bucket
  undivided (torch's hooks divide themselves) and returns a future of the averaged buffer.

A new kind (a reduce-scatter, for sharded optimizer state) is a new subclass: the reducer's
launch path only calls ``start``, ``end_of_pass`` and ``finish``.

Errors are returned rather than raised (``Started.errors``), so a failing rank still issues
every collective and the others do not hang; the reducer raises them at the end of backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .bucket_set import BucketSet
from .errors import add_note, hook_not_future
from .grad_bucket import GradBucket

CommHook = Callable[[Any, GradBucket], torch.futures.Future[Any]]


def hook_name(hook: CommHook) -> str:
    """How messages name a comm hook."""
    return getattr(hook, "__qualname__", None) or repr(hook)


class Started(NamedTuple):
    """What starting one bucket gave: what to wait for (None when the start itself failed), and problems."""

    pending: Any
    errors: list[str | Exception]


class LaunchContext(NamedTuple):
    """What a reduction needs to know about the backward it starts a bucket of."""

    buckets: BucketSet
    take_divisor: Callable[[], float]
    unused: set[int]  # marked ready without a gradient in this backward
    names: list[str]
    as_view: bool
    rank: int
    iteration: int

    @property
    def where(self) -> str:
        return f"rank {self.rank}, iteration {self.iteration}"


class Reduction:
    """The interface: ``start`` each bucket in order, ``end_of_pass`` once, ``finish`` at the end of backward."""

    name: str | None = None  # how messages name it: a comm hook's name, None for the built-in all-reduce
    hook: CommHook | None = None
    state: Any = None  # a comm hook's state
    reduces_lone_in_place = False  # may a lone large gradient be reduced in its own .grad?
    holds_buckets = True  # False: the flat buffers are allocated only while a bucket is sent
    # Who else a joined rank must shadow with this reduction (a sharded optimizer's step), or None.
    join_partner: Any = None

    def adopt_buckets(self, buckets: BucketSet) -> None:
        """The reducer's buckets were (re)built: a reduction that keeps per-bucket state rebuilds it."""

    def before_rebuild(self) -> None:
        """New buckets are about to replace the current ones: let go of views of their buffers."""

    def start(self, context: LaunchContext, b: int) -> Started:
        raise NotImplementedError

    def start_zeros(self, buckets: BucketSet, b: int) -> Any:
        """A joined rank's part of bucket ``b``: the same collective with zeros (uneven_inputs.py)."""
        raise NotImplementedError

    def end_of_pass(self) -> None:
        """Every bucket of this pass was launched or skipped."""

    def finish_tolerant(
        self, buckets: BucketSet, current: Any, tolerance: Any, globally_used: list[bool] | None
    ) -> None:
        """The fault-tolerant mode's end of backward: wait, note failures, keep results for the vote (tolerance.py)."""
        tolerance.wait_and_defer(buckets, current, self.name, globally_used)

    def finish_shadow(self, buckets: BucketSet, pending: list[Any], globally_used: list[bool] | None) -> None:
        """A joined rank's end of backward: wait for what ``start_zeros`` started (its ``.grad`` stays)."""
        for work in pending:
            work.wait()

    def finish(
        self,
        buckets: BucketSet,
        launched: list[Any],
        as_view: bool,
        globally_used: list[bool] | None,
        unused: set[int],
        times: Any,
        after_bucket: Callable[[int], None] | None,
    ) -> list[str]:
        """Wait for every launched bucket in order and write the averages to ``.grad``; error messages back."""
        return buckets.write_back(launched, as_view, globally_used, unused, self.name, times, after_bucket)


class AllReduce(Reduction):
    """Divide each gradient by the divisor, sum over the group with one ``all_reduce`` per bucket."""

    reduces_lone_in_place = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def start(self, context: LaunchContext, b: int) -> Started:
        buckets = context.buckets
        storage = buckets.storages[b]
        if storage.sparse:  # one parameter, reduced as the sparse tensor it is
            grad = buckets.sparse_grad(b) / context.take_divisor()
            return Started(dist.all_reduce(grad, group=self.group, async_op=True).get_future(), [])
        errors: list[str | Exception] = []
        target = None
        try:
            target = buckets.in_place_target(b, context.unused, context.names)
        except RuntimeError as error:
            errors.append(f"{error} ({context.where})")
        divisor = context.take_divisor()
        if target is not None:
            if divisor != 1.0:
                target.div_(divisor)
        else:
            try:
                buckets.gather_grads(b, context.as_view, context.unused, context.names, divisor)
            except (RuntimeError, ValueError) as error:
                errors.append(f"{error} ({context.where})")
            target = storage.flat
        try:
            return Started(dist.all_reduce(target, group=self.group, async_op=True), errors)
        except RuntimeError as error:  # a dead peer can fail the launch itself
            return Started(None, [*errors, f"all-reduce failed on bucket {b}: {error}"])

    def start_zeros(self, buckets: BucketSet, b: int) -> Any:
        return dist.all_reduce(buckets.zeros_like_bucket(b), group=self.group, async_op=True)


class CommHookReduction(Reduction):
    """``hook(state, bucket) -> Future[Tensor]`` per bucket (torch's contract), on undivided gradients."""

    hook: CommHook  # never None here
    name: str

    def __init__(self, hook: CommHook, state: Any) -> None:
        self.hook = hook
        self.state = state
        self.name = hook_name(hook)

    def start(self, context: LaunchContext, b: int) -> Started:
        buckets = context.buckets
        storage = buckets.storages[b]
        is_last = b == len(buckets.storages) - 1
        if storage.sparse:
            return Started(self.hook(self.state, GradBucket(b, buckets.sparse_grad(b), storage, is_last)), [])
        errors: list[str | Exception] = []
        try:
            buckets.gather_grads(b, context.as_view, context.unused, context.names, 1.0)
        except (RuntimeError, ValueError) as error:
            errors.append(f"{error} ({context.where})")
        try:
            result = self.hook(self.state, GradBucket(b, storage.flat, storage, is_last))
        except Exception as error:  # noqa: BLE001 - re-raised from backward() once every bucket was launched
            add_note(error, f"gradsync: raised by comm hook {self.name} on bucket {b} ({context.where})")
            return Started(None, [*errors, error])
        if not isinstance(result, torch._C.Future):  # torch.futures.Future and what .get_future() returns
            problem = RuntimeError(hook_not_future(self.name, result, b, context.rank, context.iteration))
            return Started(None, [*errors, problem])
        return Started(result, errors)

    def start_zeros(self, buckets: BucketSet, b: int) -> Any:
        zeros = buckets.zeros_like_bucket(b)
        return self.hook(self.state, GradBucket(b, zeros, buckets.storages[b], b == len(buckets.storages) - 1))

    def end_of_pass(self) -> None:
        """Tell the hook that no bucket follows in this pass.

        A hook may leave part of a bucket's work for its next call (gradsync's PowerSGD does:
        [Note: P in flight] in hooks/low_rank.py); its state's ``finish_launches`` does that work
        now. Other states (torch's included, and ``None``) have no such method.
        """
        finish = getattr(self.state, "finish_launches", None)
        if callable(finish):
            finish()
