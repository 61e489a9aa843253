"""The parameters of every bucket in one padded flat buffer, and the all-gather that refreshes it.

[Note: parameters gathered in place]
With a sharded optimizer each rank steps only its range of every bucket ([Note: shard each
bucket] in engine/sharding.py). After the step every rank needs every range again, so each
bucket's parameters live in one flat buffer, padded like the bucket: the parameters' ``.data``
are views of it (shaped and strided as before), a rank's range of it is one contiguous slice, and
one ``all_gather`` per bucket writes every rank's range into place. Nothing is copied in or out
and no receive buffer exists.

The gathers are started in ``start`` (from the optimizer's ``step``, which every rank calls) in
the order the first forward used the buckets. By default (``overlap_param_gather=True``) they
overlap the next forward: a forward pre-hook on every module waits for the buckets that module's
code reads ([Note: what a module's forward reads] in param_reads.py), so the forward computes
while the later buckets are still on the wire. Between the step and that forward, a dispatch mode
makes anything else this thread runs on a parameter wait for its bucket first ([Note: the guard
over parameters in flight] in stale_guard.py); at the end of a forward whatever it did not use is
waited for. A wait is never a collective, so a module run on one rank alone (an evaluation on
rank 0) is safe. With ``overlap_param_gather=False``, ``step`` waits for every gather before it
returns.

The gathers go over their own process group when the optimizer steps in backward
([Note: the step inside backward] in backward_step.py): there a bucket's gather starts when its
reduce-scatter drained, which differs between ranks relative to the next reduce-scatters; on one
group that would pair different collectives across ranks. Each group alone sees the same order
on every rank (bucket order).

``state_dict`` would serialise each view's whole flat buffer; a state-dict hook hands out compact
copies of the parameters instead, so a checkpoint is the same bytes as with plain DDP.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.sharded import start_all_gather
from ..engine.bucket_set import BucketSet
from ..engine.sharding import ShardLayout
from ..engine.storage import make_view
from .dispatch_modes import storage_key
from .param_reads import ModuleReads
from .stale_guard import StaleGuard


class ParamBuffers:
    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        names: list[str],
        group: dist.ProcessGroup,
        gather_group: Any = None,
    ) -> None:
        """``gather_group``: the group the all-gathers go over (over the ranks of ``group``), if not ``group``."""
        self.group = group
        self.gather_group = group if gather_group is None else gather_group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.params, self.names = params, names  # by engine index
        self.buckets: BucketSet | None = None
        self.layout: ShardLayout | None = None
        self.flats: list[torch.Tensor] = []  # per bucket: its parameters, padded; the parameters are views
        self.pending: dict[int, Any] = {}  # bucket -> its all-gather in flight
        self.failed: dict[int, RuntimeError] = {}  # bucket -> why its last all-gather failed (it is not whole)
        # storage -> starts, ends, params (storage_key's None, for tensors without a storage, never among them)
        self._spans: dict[int | None, tuple[list[int], ...]] = {}
        # What each module reads, learned in the first forward ([Note: what a module's forward reads]).
        self.reads = ModuleReads(module, params, weakref.WeakMethod(self.locate))
        self._waits: dict[nn.Module, list[int]] = {}  # module -> the buckets its forward pre-hook waits for
        # Hooks hold this object weakly: a deepcopy of the module (an EMA copy, say) copies the hook
        # functions as they are, and a copy's modules are simply not found here.
        this = weakref.ref(self)
        self.guard = StaleGuard(self)  # stale_guard.py
        self._handles = [
            module.register_forward_pre_hook(weakly(this, "_forward_starts"), prepend=True),
            module.register_forward_hook(weakly(this, "_forward_ends"), always_call=True),
        ]
        before_module = weakly(this, "_before_module")
        self._handles += [m.register_forward_pre_hook(before_module) for m in self.reads.hooked]
        self._handles.append(module._register_state_dict_hook(weakly(this, "_compact_state_dict")))
        # Loading a state dict writes the parameters: no gather may land on them afterwards.
        self._handles.append(module._register_load_state_dict_pre_hook(weakly(this, "wait_all_ignoring")))

    # ------------------------------------------------------------------ layout
    def regroup(self, group: dist.ProcessGroup, gather_group: Any = None) -> None:
        """Gather over ``group`` from now on (the DDP moved to it; ``adopt`` then lays the buffers out)."""
        self.wait_all()
        self.group = group
        self.gather_group = group if gather_group is None else gather_group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def adopt(self, buckets: BucketSet, layout: ShardLayout) -> None:
        """Move every parameter into the flat buffers of ``buckets`` (same values, new storage)."""
        self.wait_all()
        self.buckets, self.layout = buckets, layout
        self.flats, self._spans = [], {}
        with torch.no_grad():
            for b, storage in enumerate(buckets.storages):
                flat = torch.zeros(layout.padded[b], dtype=storage.params[0].dtype, device=buckets.device)
                spans = []
                for index, offset in zip(storage.param_indices, storage.offsets):
                    param = self.params[index]
                    view = make_view(flat, offset, param)
                    view.copy_(param.data)
                    param.data = view
                    spans.append((offset, offset + extent(view), index))
                self.flats.append(flat)
                spans.sort()
                self._spans[storage_key(flat)] = tuple(list(column) for column in zip(*spans))
        self._compute_waits()

    def own_range(self, b: int) -> torch.Tensor:
        """This rank's range of bucket ``b``'s flat parameter buffer (a view: writes reach the parameters)."""
        size = self.layout.shard_numel[b]  # type: ignore[union-attr]  # adopted
        return self.flats[b].narrow(0, self.rank * size, size)

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The index of the parameter ``tensor`` is, or is a view of; None if it is none of them."""
        spans = self._spans.get(storage_key(tensor))
        if spans is None:
            return None
        starts, ends, indices = spans
        offset = tensor.storage_offset()
        k = bisect.bisect_right(starts, offset) - 1
        return indices[k] if k >= 0 and offset < ends[k] else None

    def gather_order(self) -> list[int]:
        """The buckets in the order the first forward first used them, then the rest (later buckets first)."""
        bucket_of, count = self.buckets.bucket_of, len(self.flats)  # type: ignore[union-attr]  # adopted
        used = list(dict.fromkeys(bucket_of[i] for i in self.reads.first_use))
        return used + [b for b in reversed(range(count)) if b not in used]

    def _compute_waits(self) -> None:
        bucket_of = self.buckets.bucket_of  # type: ignore[union-attr]  # adopted
        self._waits = {m: sorted({bucket_of[i] for i in self.reads.wanted(m)}) for m in self.reads.hooked}

    # ------------------------------------------------------------------ gathers
    def start(self, order: Iterable[int]) -> None:
        """Start every bucket's all-gather, in ``order`` (the same on every rank)."""
        for b in order:
            self.pending[b] = start_all_gather(self.flats[b], self.own_range(b), self.gather_group)

    def guard_in_flight(self) -> bool:
        """Watch the buckets in flight until they are waited for (stale_guard.py); False where that cannot be."""
        if not self.pending:
            return True
        return self.guard.arm({storage_key(self.flats[b]): b for b in self.pending})

    def gather_now(self, order: Iterable[int]) -> None:
        """Every bucket's all-gather, waited for here (received in place: nothing is allocated for them)."""
        works = [start_all_gather(self.flats[b], self.own_range(b), self.gather_group) for b in order]
        for work in works:
            work.wait()

    def wait(self, b: int) -> None:
        """Until bucket ``b``'s parameters are whole here; a gather that failed raises, now and at every later wait."""
        if b in self.failed:
            raise self.failed[b]
        work = self.pending.pop(b, None)
        if work is None:
            return
        self._take(b, work)  # the guard keeps watching a bucket that failed: every later read raises too
        self.guard.forget(storage_key(self.flats[b]))

    def settled(self) -> bool:
        """Whether every gather in flight has arrived (then taken as waited for) and none failed; never blocks."""
        for b in list(self.pending):
            if not self.pending[b].is_completed():
                return False
            try:
                self._take(b, self.pending.pop(b))
            except RuntimeError:
                pass
        return not self.failed

    def _take(self, b: int, work: Any) -> None:
        """Wait for bucket ``b``'s gather ``work``; a failure is kept (and raised) as the error that names it."""
        try:
            work.wait()
        except Exception as error:
            self.failed[b] = self._gather_failed(b, error)
            raise self.failed[b] from error

    def wait_all(self) -> None:
        for b in [*self.failed, *self.pending]:
            self.wait(b)
        self.guard.disarm()

    def wait_all_ignoring(self, *args: Any) -> None:
        """Before a state dict is loaded into the parameters: whatever failed to arrive is overwritten now."""
        for b in list(self.pending):
            try:
                self.wait(b)
            except RuntimeError:
                pass
        self.failed = {}
        self.guard.disarm()

    def _gather_failed(self, b: int, error: BaseException) -> RuntimeError:
        names = [self.names[i] for i in self.buckets.storages[b].param_indices]  # type: ignore[union-attr]  # adopted
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return RuntimeError(
            f"The all-gather of the parameters after the last optimizer step failed on rank {self.rank} (bucket {b}: "
            f"{shown}), so they are not whole on this rank: {error}. The step's all-gathers overlap the next "
            "forward (overlap_param_gather=True). If the process group was destroyed right after optimizer.step(), "
            "call optimizer.wait_for_params() before dist.destroy_process_group(), or build the ShardedOptimizer "
            "with overlap_param_gather=False; if a rank died, restart from the last checkpoint."
        )

    # ------------------------------------------------------------------ the forward
    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        self.guard.disarm()  # from here the module hooks wait, each for what its module reads
        self.reads.forward_starts(module)

    def _before_module(self, module: nn.Module, args: Any) -> None:
        if self.pending or self.failed:  # a bucket whose gather failed raises before a module computes with it
            for b in self._waits.get(module, ()):
                self.wait(b)

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.reads.forward_ends(output):
            self._compute_waits()
        self.wait_all()  # what this forward did not use (unused parameters): nothing else waits for it

    def _compact_state_dict(self, module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        """Parameters are saved as tensors of their own, not as views of a flat buffer ([Note:
        parameters gathered in place]); ``keep_vars=True`` callers (who copy into them) get them as they are."""
        self.wait_all()
        flats = {flat.untyped_storage().data_ptr() for flat in self.flats}
        for key, value in state.items():
            if isinstance(value, nn.Parameter) or not isinstance(value, torch.Tensor):
                continue
            if value.untyped_storage().data_ptr() in flats:
                state[key] = value.clone(memory_format=torch.preserve_format)


def extent(view: torch.Tensor) -> int:
    """How many elements of its storage a view spans from its first one (strided views included)."""
    if view.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))


def weakly(ref: weakref.ref[Any], method: str) -> Callable[..., None]:
    """A hook calling ``method`` of the object ``ref`` refers to, while it lives.

    Never traced by torch.compile (a hook of a compiled module runs eagerly, as a graph break): it
    waits for work in flight and keeps state that a graph would freeze."""

    def hook(*args: Any) -> None:
        owner = ref()
        if owner is not None:
            getattr(owner, method)(*args)

    return cast("Callable[..., None]", torch.compiler.disable(hook))
