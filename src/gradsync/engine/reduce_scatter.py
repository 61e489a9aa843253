"""``ReduceScatter``: each bucket reduce-scattered, each rank keeping the average of its range.

The reduction a sharded optimizer (``gradsync.zero``) puts in the reducer in place of the
all-reduce ([Note: shard each bucket] in sharding.py). A bucket starts from the same ready hook,
in the same launch order: its gradients are copied into the (padded) flat buffer, divided by the
world size, and sent by ``all_to_all_single`` ([Note: reduce-scatter from all_to_all] in
collectives/sharded.py). At the end of backward each rank sums what it received into its shard
of the bucket, ``grad_shards[b]``:

- ``keep_full=False`` (ZeRO-2): that is all; ``.grad`` of the bucket's parameters is set to
  ``None``: no full gradient is kept.
- ``keep_full=True`` (ZeRO-1): the shards are all-gathered back into the flat buffer and written
  to ``.grad`` as the all-reduce would; together the two collectives move what one all-reduce
  moves, and the sum is the same on every rank whatever the bucket layout.

Low precision on the wire (``mixed_precision``'s ``reduce_dtype``, in which the buckets are kept,
or a cast hook's dtype, ``compress``): the chunks are sent in it and added up in the shards,
which are in the parameters' dtype, so the sum is never rounded to the low precision.

Several synced backwards before the shards are consumed (``consumed()``, by the optimizer's step
or ``zero_grad``) add up, as ``.grad`` does with DDP (ZeRO-1 through ``.grad`` itself).

A listener (``listen``: the optimizer's ``step_in_backward``) hears of each bucket whose shard
holds its average for this pass: as the bucket drains, or, when which parameters were used is
only known at the end of backward (``find_unused_parameters``, ``static_graph``), in ``finish``,
in bucket order. Either way in the same order on every rank, so collectives it starts match.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.sharded import PendingReduceScatter, start_all_gather, start_reduce_scatter, summed_on_arrival
from ..observability.timing import IterationTimes, now
from .bucket_set import BucketSet
from .reductions import LaunchContext, Reduction, Started
from .sharding import ShardLayout
from .storage import BucketStorage
from .tolerance import DeferredStep, Tolerance

# Buckets sent and not yet drained when the next launches, by default: [Note: buckets released as
# they drain]. ZeRO-2's buckets then share one send buffer.
IN_FLIGHT = 1


class ReduceScatter(Reduction):
    def __init__(self, group: dist.ProcessGroup, keep_full: bool, in_flight: int = IN_FLIGHT) -> None:
        """``in_flight``: how many buckets may be on the wire, undrained, when the next one launches;
        each one more costs a send buffer ([Note: buckets released as they drain])."""
        self.group = group
        self.in_flight = in_flight
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.keep_full = keep_full
        self.holds_buckets = keep_full  # ZeRO-2: [Note: buckets released as they drain]
        self.layout: ShardLayout | None = None
        self.grad_shards: list[torch.Tensor] = []  # per bucket: this rank's range of the average
        # Per bucket: the shard holds results not yet consumed by a step (the next backward adds).
        self.filled: list[bool] = []
        # Per parameter (engine index): whether it got a gradient on some rank in the backwards since
        # the shards were consumed; None: every one did (no find_unused_parameters). Parameters that
        # did not, and those of buckets not filled, are not stepped (DDP leaves their .grad None).
        self.used: list[bool] | None = None
        self._partner: Callable[[], Any] | None = None  # a weak reference: the optimizer holds the engine
        self._listener: Callable[[], Any] | None = None  # weakly too: hears of averaged buckets (``listen``)
        self._listen_at_drain = False
        # What the gradients are sent in: a cast hook's dtype (hooks/shardable.py), or None: the buckets' own.
        self.wire_dtype: torch.dtype | None = None
        self.views = False  # ZeRO-1 with .grad as views of the buckets, and shards in them (adopt_buckets)
        self._in_flight: list[tuple[int, PendingReduceScatter, BucketStorage]] = []  # launched, not drained
        self._done_at: dict[int, float] = {}  # drained buckets of this pass: when
        self._first_of_pass: bool | None = None  # whether this pass is the first since the shards were consumed
        self._storages: list[BucketStorage] = []
        # Off CPU, per dtype and device, ``in_flight`` receive buffers (bucket b uses number b % in_flight),
        # made on first use; on CPU the chunks are summed as they arrive ([Note: a reduce-scatter summed
        # as it arrives] in collectives/segmented.py).
        self._receive: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._largest: dict[tuple[torch.dtype, torch.device], int] = {}
        self._buffers_suspect = False  # a collective failed: the shared buffers are replaced before reuse

    def compress(self, hook: Any, state: Any, name: str, wire_dtype: torch.dtype | None) -> None:
        """Send in ``wire_dtype`` what the cast hook ``hook`` would have (kept to name it, and to refuse a second)."""
        self.hook, self.state, self.name, self.wire_dtype = hook, state, name, wire_dtype

    @property
    def join_partner(self) -> Any:
        """The sharded optimizer stepping these shards: a joined rank shadows its step too."""
        return None if self._partner is None else self._partner()

    def set_join_partner(self, partner: Any) -> None:
        self._partner = weakref.ref(partner)

    def listen(self, listener: Any, at_drain: bool) -> None:
        """Call ``listener.bucket_averaged(b)`` once bucket ``b``'s shard holds this pass's average:
        as it drains (``at_drain``), or in ``finish`` once every rank agreed which parameters were used."""
        self._listener, self._listen_at_drain = weakref.ref(listener), at_drain

    def _tell(self, b: int) -> None:
        listener = None if self._listener is None else self._listener()
        if listener is not None:
            listener.bucket_averaged(b)

    def adopt_buckets(self, buckets: BucketSet) -> None:
        if any(storage.sparse for storage in buckets.storages):
            names = [i for s in buckets.storages if s.sparse for i in s.param_indices]
            raise ValueError(
                f"Parameters {names} (engine indices) produce sparse gradients, which cannot be sharded; "
                "construct the model with nn.Embedding(sparse=False) to use a sharded optimizer."
            )
        self.layout = ShardLayout(buckets, self.world_size)
        storages = buckets.storages
        # ZeRO-1: .grad are views of the buckets and each shard is the bucket's own range, unless the
        # buckets are in another dtype than the parameters (mixed_precision): then both are copies.
        self.views = self.keep_full and all(s.flat.dtype == s.params[0].dtype for s in storages)
        if self.views:
            self.grad_shards = [s.flat.narrow(0, self.rank * n, n) for n, s in zip(self.layout.shard_numel, storages)]
        else:
            # In the parameters' dtype: under mixed_precision the chunks add up in full precision,
            # and the optimizer steps full-precision master shards.
            self.grad_shards = [
                torch.zeros(n, dtype=s.params[0].dtype, device=buckets.device)
                for n, s in zip(self.layout.shard_numel, storages)
            ]
        self._storages = storages
        self._share_buffers()
        self.filled = [False] * len(self.grad_shards)
        self.used = None
        self._in_flight = []
        self._first_of_pass = None

    def _share_buffers(self) -> None:
        """For ZeRO-2, ``in_flight`` send buffers as large as the largest bucket, bucket b using number
        b % in_flight (the buckets' flat storage); off CPU as many receive buffers, made on first use.

        [Note: buckets released as they drain] says why that many are enough. Reused, they cost
        no allocation per bucket and step: fresh buffers each time made the allocator hand out new
        pages (page faults, system time) and kept the resident size near DDP's, and gloo's
        all_to_all is slower into fresh memory (benchmarks/results/2026-12-01-zero-speed-large_grad.md).
        """
        largest: dict[tuple[torch.dtype, torch.device], int] = {}
        for storage in self._storages:
            key = (storage.flat.dtype, storage.flat.device)
            largest[key] = max(largest.get(key, 0), storage.flat.numel())
        slots = range(self.in_flight)
        if not self.keep_full:  # ZeRO-1's buckets are its .grad: each keeps its own
            send = {key: [torch.zeros(n, dtype=key[0], device=key[1]) for _ in slots] for key, n in largest.items()}
            for b, storage in enumerate(self._storages):
                storage.share(send[(storage.flat.dtype, storage.flat.device)][b % self.in_flight])
        self._largest, self._receive = largest, {}
        self._buffers_suspect = False

    def _receive_buffer(self, storage: BucketStorage, b: int) -> torch.Tensor | None:
        """Where ``all_to_all_single`` receives bucket ``b`` (None: on CPU nothing is received whole)."""
        key = (storage.flat.dtype, storage.flat.device)
        if summed_on_arrival(key[1]):
            return None
        if key not in self._receive:
            n, dtype = self._largest[key], self.wire_dtype or key[0]
            self._receive[key] = [torch.empty(n, dtype=dtype, device=key[1]) for _ in range(self.in_flight)]
        return self._receive[key][b % self.in_flight]

    def before_rebuild(self) -> None:
        if self.views:
            self.grad_shards = []  # views of the old buckets, which then go before the new ones exist

    def start(self, context: LaunchContext, b: int) -> Started:
        storage = context.buckets.storages[b]
        if self._first_of_pass is None:
            self._first_of_pass = not any(self.filled)
        errors: list[str | Exception] = self._drain(keep=self.in_flight - 1)
        as_view = context.as_view or self.views
        try:
            if self._buffers_suspect:  # a failed collective may still write into them: fresh ones
                self._share_buffers()
            if not self.keep_full:
                storage.zero_padding()  # the shared buffer's tail holds what a larger bucket left
            receive = self._receive_buffer(storage, b)
            context.buckets.gather_grads(b, as_view, context.unused, context.names, context.take_divisor())
        except (RuntimeError, ValueError) as error:
            return Started(None, [*errors, f"{error} ({context.where})"])
        if not self.keep_full:
            for param in storage.params:
                param.grad = None  # ZeRO-2 keeps no full gradient: the bucket holds it until it is sent
        try:
            pending = start_reduce_scatter(
                storage.flat, self.grad_shards[b], self._accumulates(b), self.group, self.wire_dtype, receive
            )
        except RuntimeError as error:  # a dead peer can fail the launch itself
            self._buffers_suspect = True
            return Started(None, [*errors, f"reduce-scatter failed on bucket {b}: {error}"])
        self._in_flight.append((b, pending, storage))
        return Started(pending, errors)

    def _drain(self, keep: int) -> list[str | Exception]:
        """Finish the buckets sent, oldest first, until at most ``keep`` are in flight.

        [Note: buckets released as they drain]
        ZeRO-2 needs a bucket's full gradient only from its launch until its reduce-scatter
        completed; ``.grad`` is dropped at the launch. A bucket drains at the next launch after it
        completed, and at the latest when it is the ``in_flight``-th one before the bucket
        launching. With ``in_flight == 1`` (the default) every bucket has drained before the next one
        is gathered, so all of them share one send buffer (``_share_buffers``; on CPU nothing is
        received whole: [Note: a reduce-scatter summed as it arrives] in collectives/segmented.py):
        the gradient held at any time is the bucket filling (autograd's ``.grad``) plus that buffer,
        instead of all of it. Each bucket more in flight costs one more, and lets
        backward go on computing while the bucket before is still on the wire instead of waiting
        for it (``step_in_backward`` takes 2: its all-gathers share the link with the reduce-scatters).
        Draining is local: when it happens does not change which collectives a rank issues on this
        group, or their order (a listener's all-gathers go over a group of their own). ZeRO-1 keeps
        its buckets (they are ``.grad``).
        """
        errors: list[str | Exception] = []
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0][1].work.is_completed()):
            b, pending, storage = self._in_flight.pop(0)
            try:
                pending.finish()
            except Exception as error:  # noqa: BLE001 - reported with the bucket named
                errors.append(f"reduce-scatter failed on bucket {b}: {error}")
                pending.failed = True
                self._buffers_suspect = True
                continue
            self._done_at[b] = now()
            self.filled[b] = True
            if self._listen_at_drain:
                self._tell(b)
        return errors

    def start_zeros(self, buckets: BucketSet, b: int) -> Any:
        return start_reduce_scatter(
            buckets.zeros_like_bucket(b), self.grad_shards[b], self._accumulates(b), self.group, self.wire_dtype
        )

    def _accumulates(self, b: int) -> bool:
        """Whether bucket ``b``'s reduce-scatter adds to its shard: ZeRO-2's shard still holds an earlier
        backward's average not yet stepped; ZeRO-1 accumulates in ``.grad`` (the bucket), as DDP does."""
        return self.filled[b] and not self.keep_full

    def finish_shadow(self, buckets: BucketSet, pending: list[Any], globally_used: list[bool] | None) -> None:
        """A joined rank still owns its range of every bucket: it keeps the others' average there.

        Its shards are then what its optimizer steps (``join_partner``, in the join hook), so the
        ranks still training get that range back from it in the all-gather. ZeRO-1 all-gathers
        the shards as the training ranks do, into a scratch buffer: a joined rank has no ``.grad``
        to write.
        """
        self._note_used(globally_used, first=not any(self.filled))
        gathers = []
        for b, work in enumerate(pending):
            work.finish()
            self.filled[b] = True
            if self.keep_full:
                scratch = torch.empty(buckets.storages[b].flat.shape, dtype=self.grad_shards[b].dtype)
                gathers.append(start_all_gather(scratch, self.grad_shards[b], self.group, self.wire_dtype))
        for work in gathers:
            work.wait()

    def finish(
        self,
        buckets: BucketSet,
        launched: list[Any],
        as_view: bool,
        globally_used: list[bool] | None,
        unused: set[int],
        times: IterationTimes,
        after_bucket: Callable[[int], None] | None,
    ) -> list[str]:
        errors = [str(e) for e in self._drain(keep=0)]
        first, self._first_of_pass = self._first_of_pass, None
        self._note_used(globally_used, first=first if first is not None else not any(self.filled))
        for b, done_at in self._done_at.items():
            times.bucket_done[b] = times.bucket_done[b] or done_at
        self._done_at = {}
        if not self.keep_full:
            times.reductions_done = max(times.bucket_done, default=0.0) or now()
            buckets.begin_iteration()
            if self._listener is not None and not self._listen_at_drain:
                for b in [b for b, filled in enumerate(self.filled) if filled]:
                    self._tell(b)
            return errors
        gathers: list[Any] = []
        for b, pending in enumerate(launched):
            if pending is None or pending.failed:
                gathers.append(None)  # skipped (every parameter unused) or failed: nothing arrived
                continue
            flat = buckets.storages[b].flat
            gathers.append(_GatherWhenWaited(flat, self.grad_shards[b], self.group, self.wire_dtype))
        errors.extend(buckets.write_back(gathers, as_view or self.views, globally_used, unused, None, times))
        return errors

    def finish_tolerant(
        self, buckets: BucketSet, current: Any, tolerance: Tolerance, globally_used: list[bool] | None
    ) -> None:
        """Under ``gradsync.elastic``: a failed collective is a failure of the step, noted for the vote.

        The results go straight into the shards (and, at stage 1, ``.grad``): a step that does not
        commit cannot be redone over the survivors anyway, since a dead rank's shards died with it;
        the fault-tolerant wrapper raises then, naming them (``describe_lost_shards``).
        """
        tolerance.take_launch_failures(current)
        try:
            if tolerance.failures:
                raise RuntimeError("; ".join(tolerance.failures))
            for _, pending, _ in self._in_flight:
                if tolerance.waiter is not None:
                    tolerance.waiter(pending.work)  # in slices, giving up when a peer stops beating
            as_view = False  # the fault-tolerant mode refuses gradient_as_bucket_view
            times, unused = current.times, current.marked_unused
            problems = self.finish(buckets, current.launched, as_view, globally_used, unused, times, None)
        except RuntimeError as error:
            problems = [str(error)]
        if problems:
            tolerance.failures.extend(p for p in problems if p not in tolerance.failures)
            self._in_flight, self._first_of_pass = [], None
            tolerance.abandon(current.launched, buckets)
            return
        tolerance.deferred = DeferredStep([], [], globally_used, set())  # nothing left to write

    def _note_used(self, globally_used: list[bool] | None, first: bool) -> None:
        """Used in this backward or an earlier one since the shards were consumed (None: all)."""
        if first or globally_used is None:
            self.used = None if globally_used is None else list(globally_used)
        elif self.used is not None:
            self.used = [a or b for a, b in zip(self.used, globally_used)]

    def is_used(self, param: int, bucket: int) -> bool:
        """Whether parameter ``param`` (in ``bucket``) has a gradient to step in the shards."""
        return self.filled[bucket] and (self.used is None or self.used[param])

    def consumed(self) -> None:
        """The optimizer stepped on the shards (or ``zero_grad`` cleared them): the next backward overwrites."""
        self.filled = [False] * len(self.filled)
        self.used = None

    def consumed_bucket(self, b: int) -> None:
        """Bucket ``b``'s shard was stepped (in backward): the next backward overwrites it. ``used``
        stays: the later buckets of this pass are stepped with it, and the next pass replaces it."""
        self.filled[b] = False


class _GatherWhenWaited:
    """ZeRO-1's all-gather of one bucket's shards, started only when ``write_back`` waits for it.

    A gather sent in a low precision (``mixed_precision``, a cast hook) receives into a temporary
    as large as its output; one at a time keeps that to one bucket, at the cost of the small gap
    between two gathers at the end of backward.
    """

    __slots__ = ("flat", "shard", "group", "wire_dtype")

    def __init__(self, flat: torch.Tensor, shard: torch.Tensor, group: Any, wire_dtype: torch.dtype | None) -> None:
        self.flat, self.shard, self.group, self.wire_dtype = flat, shard, group, wire_dtype

    def wait(self) -> None:
        start_all_gather(self.flat, self.shard, self.group, self.wire_dtype).wait()
