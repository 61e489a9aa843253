"""The parameters of every bucket in one padded flat buffer, and the all-gather that refreshes it.

[Note: parameters gathered in place]
With a sharded optimizer each rank steps only its range of every bucket ([Note: shard each
bucket] in engine/sharding.py). After the step every rank needs every range again, so each
bucket's parameters live in one flat buffer, padded like the bucket: the parameters' ``.data``
are views of it (shaped and strided as before), a rank's range of it is one contiguous slice, and
one ``all_gather`` per bucket writes every rank's range into place. Nothing is copied in or out
and no receive buffer exists.

The gathers are started in ``start`` (from the optimizer's ``step``, which every rank calls) in
the order the forward first used the buckets. By default ``step`` waits for them before it returns,
so the parameters are whole on every rank from then on. With ``overlap_param_gather=True`` they are
waited for locally instead: by a forward pre-hook on every module, for the buckets holding that
module's own parameters, so the next forward computes while the later buckets are still on the
wire; by ``wait_all`` before anything else reads or writes the parameters through gradsync (the
next step, a relayout, ``state_dict``). A wait is never a collective, so a module run on one rank
alone (an evaluation on rank 0) is safe; but code that reads parameters between ``step`` and the
next forward by itself (an EMA of the weights, a norm for logging) must call the optimizer's
``wait_for_params()`` first, or it reads some ranges from before the step.

The gathers go over their own process group when the optimizer steps in backward
([Note: the step inside backward] in backward_step.py): there a bucket's gather starts when its
reduce-scatter drained, which differs between ranks relative to the next reduce-scatters; on one
group that would pair different collectives across ranks. Each group alone sees the same order
on every rank (bucket order).

``state_dict`` would serialise each view's whole flat buffer; a state-dict hook hands out compact
copies of the parameters instead, so a checkpoint is the same bytes as with plain DDP.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.sharded import start_all_gather
from ..engine.bucket_set import BucketSet
from ..engine.sharding import ShardLayout
from ..engine.storage import make_view


class ParamBuffers:
    def __init__(
        self, module: nn.Module, params: list[torch.Tensor], group: dist.ProcessGroup, gather_group: Any = None
    ) -> None:
        """``gather_group``: the group the all-gathers go over (over the ranks of ``group``), if not ``group``."""
        self.group = group
        self.gather_group = group if gather_group is None else gather_group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.params = params  # by engine index
        self.buckets: BucketSet | None = None
        self.layout: ShardLayout | None = None
        self.flats: list[torch.Tensor] = []  # per bucket: its parameters, padded; the parameters are views
        self.pending: dict[int, Any] = {}  # bucket -> its all-gather in flight
        self.order: list[int] = []  # gather order: buckets in the order the forward first used them
        self.recorded: list[int] = []  # first uses seen in the current forward, while recording
        self.recording = True
        index = {id(p): i for i, p in enumerate(params)}
        self._own = {m: [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index] for m in module.modules()}
        self._buckets_of: dict[nn.Module, list[int]] = {}
        # Hooks hold this object weakly: a deepcopy of the module (an EMA copy, say) copies the hook
        # functions as they are, and a copy's modules are simply not found here.
        this = weakref.ref(self)
        self._handles = [m.register_forward_pre_hook(weakly(this, "_before_module")) for m in self._own if self._own[m]]
        self._handles.append(module._register_state_dict_hook(weakly(this, "_compact_state_dict")))
        # Loading a state dict writes the parameters: no gather may land on them afterwards.
        self._handles.append(module._register_load_state_dict_pre_hook(weakly(this, "wait_all_ignoring")))

    # ------------------------------------------------------------------ layout
    def adopt(self, buckets: BucketSet, layout: ShardLayout) -> None:
        """Move every parameter into the flat buffers of ``buckets`` (same values, new storage)."""
        self.wait_all()
        self.buckets, self.layout = buckets, layout
        with torch.no_grad():
            self.flats = []
            for b, storage in enumerate(buckets.storages):
                flat = torch.zeros(layout.padded[b], dtype=storage.params[0].dtype, device=buckets.device)
                for index, offset in zip(storage.param_indices, storage.offsets):
                    param = self.params[index]
                    view = make_view(flat, offset, param)
                    view.copy_(param.data)
                    param.data = view
                self.flats.append(flat)
        self._buckets_of = {
            m: sorted({buckets.bucket_of[i] for i in indices}) for m, indices in self._own.items() if indices
        }
        self.order = list(reversed(range(len(buckets.storages))))  # later buckets hold earlier layers
        self.recorded, self.recording = [], True

    def own_range(self, b: int) -> torch.Tensor:
        """This rank's range of bucket ``b``'s flat parameter buffer (a view: writes reach the parameters)."""
        size = self.layout.shard_numel[b]
        return self.flats[b].narrow(0, self.rank * size, size)

    # ------------------------------------------------------------------ gathers
    def start(self, order: Iterable[int]) -> None:
        """Start every bucket's all-gather, in ``order`` (the same on every rank)."""
        for b in order:
            self.pending[b] = start_all_gather(self.flats[b], self.own_range(b), self.gather_group)

    def gather_now(self, order: Iterable[int]) -> None:
        """Every bucket's all-gather, one after the other: gloo allocates a temporary as large as a
        bucket for each gather it runs (two at a time), so when nothing is to overlap them, one."""
        for b in order:
            start_all_gather(self.flats[b], self.own_range(b), self.gather_group).wait()

    def wait(self, b: int) -> None:
        work = self.pending.pop(b, None)
        if work is not None:
            work.wait()

    def wait_all(self) -> None:
        for b in list(self.pending):
            self.wait(b)

    def wait_all_ignoring(self, *args: Any) -> None:
        self.wait_all()

    def _before_module(self, module: nn.Module, args: Any) -> None:
        for b in self._buckets_of.get(module, ()):
            if self.recording and b not in self.recorded:
                self.recorded.append(b)
            self.wait(b)

    def end_recording(self) -> list[int]:
        """The forward's first-use order, completed with the buckets it did not use; recording stops."""
        self.recording = False
        return self.recorded + [b for b in self.order if b not in self.recorded]

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

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def weakly(ref: weakref.ref, method: str) -> Callable[..., None]:
    """A hook calling ``method`` of the object ``ref`` refers to, while it lives."""

    def hook(*args: Any) -> None:
        owner = ref()
        if owner is not None:
            getattr(owner, method)(*args)

    return hook
