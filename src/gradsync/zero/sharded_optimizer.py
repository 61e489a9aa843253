"""``ShardedOptimizer``: optimizer state and gradients sharded over the ranks (ZeRO-1 and ZeRO-2).

    ddp = gradsync.DistributedDataParallel(model)
    optimizer = gradsync.zero.ShardedOptimizer(ddp, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(ddp(x), y).backward()     # stage 2: each bucket reduce-scattered as it fills
        optimizer.step()                  # this rank's shard stepped; all-gathers start

[Note: one all-reduce's cost]
Each bucket's flat buffer is cut into one range per rank ([Note: shard each bucket] in
engine/sharding.py). In backward a bucket is reduce-scattered, not all-reduced
(engine/reduce_scatter.py); the step updates this rank's range of every bucket only, so the
optimizer state of the other ranges does not exist here; then one all-gather per bucket brings
every rank's updated range back ([Note: parameters gathered in place] in param_buffers.py), overlapping
the next forward. Reduce-scatter and all-gather together move what one all-reduce moves.

What ``.grad`` holds after backward:

- ``stage=2``: ``None``. The average of this rank's range is in the reducer's shard of each
  bucket; nothing else of the gradient is kept. ``step`` consumes it (a second ``step`` without a
  backward in between changes nothing); several backwards before a ``step`` add up.
- ``stage=1``: the full average, as with DDP (reduce-scatter, then all-gather of the shards).

``step_in_backward=True`` (stage 2) steps each bucket's shard in backward, as its reduce-scatter
drains, and starts its all-gather there ([Note: the step inside backward] in backward_step.py).

Per rank, with fp32 parameters and Adam, bytes per parameter: stage 2 4 + 12/N, stage 1 8 + 8/N
(plain DDP 16-20). Under ``join`` (uneven inputs) a rank that ran out of data keeps stepping its
shards (zero/join.py). ``mixed_precision`` and the cast hooks (fp16/bf16 compression) set what
the gradients are sent in; they add up in the parameters' precision (engine/reduce_scatter.py).
Not supported (they raise): hooks that need the whole bucket (PowerSGD; hooks/shardable.py),
``_register_fused_optim``, sparse gradients. Under per-step ``gradsync.elastic.FaultTolerant`` a
death raises naming the lost shards (elastic/sharded_state.py); inside the islands of
``FaultTolerantDiLoCo`` the shards follow each generation's group (``follow_regrouped_engine``) and a
restarted island is healed shard by shard ([Note: shards healed across islands] in shard_copy.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..collectives.broadcast import broadcast_int_list
from ..engine.reducer import Reducer
from ..engine.sharding import Piece, ShardLayout
from ..wrapper.data_parallel import DataParallelWrapper
from . import lost_shards
from .backward_step import BackwardStep
from .checks import check_every_rank_calls, check_usable, param_groups_over
from .clipping import clip_shards
from .param_buffers import ParamBuffers, weakly
from .pieces import PieceOptimizer
from .plain_format import from_plain, to_plain
from .reducer_link import ReducerLink
from .shard_groups import ShardGroups
from .state_exchange import PieceState, exchange, gather_full, pieces_from_full


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """``optimizer_class`` over ``ddp``'s parameters, each rank stepping its shard of every bucket."""

    def __init__(
        self,
        ddp: DataParallelWrapper,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        stage: int = 2,
        *,
        elementwise: bool | None = None,
        overlap_param_gather: bool = True,
        step_in_backward: bool = False,
        state_dict_timeout_s: float = 120.0,
        **defaults: Any,
    ) -> None:
        """``params``: all of ``ddp``'s parameters, or torch's param-group dicts over them.
        ``elementwise``: vouch for an optimizer class gradsync does not know (elementwise.py): all it carries
        between steps is per parameter, in ``self.state`` (docs/zero.md, "Which optimizers").
        ``overlap_param_gather``: the parameters' all-gathers after a step overlap the next forward
        instead of finishing inside ``step``; anything that reads a parameter before then waits for it
        ([Note: the guard over parameters in flight] in stale_guard.py). False: ``step`` waits for them.
        ``step_in_backward``: stage 2 steps each bucket's shard as its reduce-scatter drains and starts its
        all-gather there; no ``clip_grad_norm_`` then ([Note: the step inside backward] in backward_step.py).
        ``state_dict_timeout_s``: how long ``state_dict`` waits for every rank to call it."""
        check_usable(ddp, optimizer_class, stage, elementwise, step_in_backward)
        self._ddp = ddp
        engine = ddp.engine
        self.stage = stage
        self.overlap_param_gather = overlap_param_gather
        self.step_in_backward = step_in_backward
        self._backward_step = BackwardStep(dist.get_rank(ddp.process_group))
        self._optimizer_class = optimizer_class
        self._kwargs = defaults
        probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # bad arguments fail here
        groups = param_groups_over(ddp, params)
        super().__init__(groups, probe.defaults)
        self._index = {id(p): i for i, p in enumerate(engine.params)}
        self._timeout = timedelta(seconds=state_dict_timeout_s)
        self._groups = ShardGroups.over(ddp.process_group, engine.buckets.device, step_in_backward, self._timeout)
        Joinable.__init__(self)
        self._params = ParamBuffers(ddp.module, engine.params, engine.names, self._groups.group, self._groups.gathers)
        self._order: list[int] | None = None  # the gather order, once the ranks agreed on one
        self._shards = PieceOptimizer(optimizer_class, defaults, self.param_groups, engine.params)  # pieces.py
        self._stepped = False
        self._attach(engine)
        self._load_piece_state({})
        this = weakref.ref(self)  # weakly, so that a deepcopy of the module does not copy the optimizer
        self._hooks = [
            ddp.module.register_forward_pre_hook(weakly(this, "_before_forward"), prepend=True),
        ]
        self._finished_init = True

    def _attach(self, engine: Reducer) -> None:
        """Make ``engine`` reduce-scatter into this optimizer's shards (reducer_link.py)."""
        self._link = ReducerLink(engine, self._groups.group, self.stage, self.step_in_backward, self)
        self._params.adopt(engine.buckets, self._link.layout)

    @property
    def _engine(self) -> Reducer:
        return self._link.engine

    def follow_engine(self) -> None:
        """The wrapper's reducer was replaced before training (the fault-tolerant mode's rewiring): use the new one.

        Only over the same ranks and before the first step: the shards are laid out over them.
        """
        engine = self._ddp.engine
        if engine is self._engine:
            return
        if self._stepped or engine.process_group is not self._groups.group:
            self._check_engine()  # raises, naming why
        self._attach(engine)
        self._load_piece_state({})

    def follow_regrouped_engine(self) -> None:
        """The wrapper's reducer was rebuilt over a new group keeping its buckets (``gradsync.elastic_diloco``
        moves an island's DDP to each generation's island group): the shards and their state move with it.

        Each rank keeps its place (an island is whole in every generation, its members in rank order), so
        it owns the same ranges and keeps its optimizer state as it is. A rank that never stepped (a
        restarted island's member, before it is healed) is laid out afresh over any group.
        """
        engine = self._ddp.engine
        if engine is self._engine:
            return
        group, size, rank = engine.process_group, dist.get_world_size(self._groups.group), self._groups.rank
        kept = dist.get_world_size(group) == size and dist.get_rank(group) == rank
        if self._stepped and not kept:
            raise RuntimeError(
                f"ShardedOptimizer on rank {dist.get_rank()}: its DDP was moved from a group of "
                f"{size} ranks (this rank {rank}) to one of "
                f"{dist.get_world_size(group)} (this rank {dist.get_rank(group)}) after it stepped, and its shards "
                "are laid out over the old ranks. Keep an island's members and their order across generations."
            )
        self._params.wait_all()  # no gather of the old group may land after the move
        state = self._piece_state() if kept else {}
        old = self._link.layout
        self._shards.release()
        self._groups = ShardGroups.over(group, engine.buckets.device, self.step_in_backward, self._timeout)
        self._params.regroup(group, self._groups.gathers)
        self._backward_step = BackwardStep(self._groups.rank)
        self._attach(engine)
        if state and old.pieces(self._groups.rank) != self._link.layout.pieces(self._groups.rank):
            state = exchange(state, old, self._link.layout, group, engine.buckets.device)  # every member does
        self._load_piece_state(state)

    def shard_state(self) -> PieceState:
        """This rank's optimizer state by piece of the current layout (no collective; to heal a peer)."""
        self._params.wait_all()
        return self._piece_state()

    def load_shard_state(self, state: PieceState) -> None:
        """Take ``state`` (by piece of the current layout, as ``shard_state`` gives it) as this rank's."""
        self._params.wait_all()
        self._load_piece_state(state)

    @property
    def shard_layout(self) -> ShardLayout:
        """Which ranges of every bucket each rank of the group owns."""
        return self._link.layout

    def describe_lost_shards(self, dead_ranks: list[int], world_size: int) -> str:
        """What died with ``dead_ranks`` (ranks of this optimizer's group), and how to go on: for errors."""
        return lost_shards.describe(self._link.layout, self._engine.names, self.stage, dead_ranks, world_size)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_engine()
        self._groups.join.check_order(self._join_config)
        Join.notify_join_context(self)
        if self._in_join():
            self._groups.join.share_hyperparameters(self.param_groups, joined=False)
        elif self.step_in_backward:
            self._backward_step.settle(self.param_groups)  # the shards were stepped in backward
            if not any(self._link.reduction.filled):  # every bucket was stepped: only its gather may be waited for
                if not (self.overlap_param_gather and self._params.guard_in_flight()):
                    self._params.wait_all()
                return loss
        self._step_shards(from_shards=self.stage == 2)
        self._stepped = True
        return loss

    @torch.no_grad()
    def bucket_averaged(self, b: int) -> None:
        """``step_in_backward``: bucket ``b``'s shard holds this backward's average: step it, start its gather.

        Called by the reduction in backward, in the same bucket order on every rank
        ([Note: the step inside backward] in backward_step.py).
        """
        if self._in_join():
            return  # stepped in step(), alongside a joined rank's shadow step
        if self._link.relaid_out():
            self._check_engine()
        self._params.wait(b)  # an all-gather of the last step may still be writing these parameters
        # The first bucket of this backward takes the hyper-parameters (LR schedulers changed them).
        self._shards.step_bucket(b, self._link.shard_grad, self._backward_step.hyperparameters(self.param_groups))
        self._link.reduction.consumed_bucket(b)
        self._params.start([b])
        self._backward_step.owed = self._stepped = True

    def _step_shards(self, from_shards: bool) -> None:
        self._params.wait_all()  # the step writes the parameters; no gather may still be writing them
        grad_of = self._link.shard_grad if from_shards else self._link.full_grad
        # Under gradsync.elastic a step commits once its collectives completed: none may be left in flight.
        if self.overlap_param_gather and not self._in_join() and not self._engine.tolerance.enabled:
            # Each bucket's gather leaves once it is stepped ([Note: gathers that leave as buckets are stepped]).
            self._shards.step_in_order(self._gather_order(), grad_of, lambda b: self._params.start([b]))
            self._link.reduction.consumed()
            if not self._params.guard_in_flight():  # another dispatch mode is on the stack (stale_guard.py)
                self._params.wait_all()
        else:
            self._shards.step(grad_of)
            self._link.reduction.consumed()
            self._params.gather_now(self._gather_order())

    def shadow_step(self) -> None:
        """A joined rank's part of the step of the ranks still training (called by the DDP's join hook).

        Its range of every bucket holds the others' average (the shadowed reduce-scatter); stepping
        it with the hyper-parameters the training ranks use now (their LR scheduler moved on) and
        all-gathering gives every rank the same parameters as if it had trained along.
        """
        self._groups.join.share_hyperparameters(self.param_groups, joined=True)
        self._step_shards(from_shards=True)

    def wait_for_params(self) -> None:
        """Wait for the all-gathers of the last step: afterwards every parameter is whole on this rank.

        A local wait, no collective. Needed only where the guard cannot see a read between a step
        and the next forward ([Note: the guard over parameters in flight] in stale_guard.py): from
        another thread, or through memory behind torch's back (``tolist()``, ``data_ptr()``).
        """
        self._params.wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        self._link.reduction.consumed()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradients so that their global norm is at most ``max_norm``; the norm before.

        Stage 1 holds the full gradient on every rank and calls torch's ``clip_grad_norm_``; stage 2
        sums over this rank's shards and all-reduces one scalar (the padding is never counted).
        """
        self._check_engine()
        if self.step_in_backward:
            raise self._backward_step.clip_error()
        if self._in_join():
            raise NotImplementedError(
                f"ShardedOptimizer.clip_grad_norm_ cannot be combined with join (rank {self._groups.rank}): a rank "
                "that ran out of data would have to take part in the norm and clip its shard too. Clip without join, "
                "or give every rank the same number of batches."
            )
        if self.stage == 1:
            params = [p for group in self.param_groups for p in group["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        grads = [g for g in map(self._link.shard_grad, self._shards.pieces) if g is not None]
        return clip_shards(grads, max_norm, norm_type, error_if_nonfinite, self._groups.group, self._link.device)

    # ------------------------------------------------------------------ pieces and their gradients
    def _load_piece_state(self, state: PieceState) -> None:
        """The inner optimizer over this rank's pieces of the current layout, with ``state`` (by piece)."""
        layout = self._link.layout
        self._shards.build(layout.pieces(self._groups.rank), self._params.own_range, len(layout.padded), state)

    def _piece_state(self) -> PieceState:
        return self._shards.state()

    @property
    def _pieces(self) -> list[Piece]:
        return self._shards.pieces

    @property
    def _inner(self) -> torch.optim.Optimizer | None:
        return self._shards.inner

    # ------------------------------------------------------------------ layout and gathers
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """The bucket rebuild after the first iteration gives new buckets: parameters and state follow."""
        self._backward_step.check_not_owed()
        if self._link.relaid_out():
            self._check_engine()
            with torch.no_grad():
                state = self._piece_state()
                # Let go of what holds the old layout (the inner optimizer's views of the old parameter
                # buffers, the old buckets), so that each old buffer is freed once its parameters moved
                # and each old state key once it was sent: the relayout then holds little more than one
                # layout at a time.
                self._shards.release()
                old, new = self._link.take_new_layout()  # laid out anew
                self._params.adopt(self._engine.buckets, new)
                self._order = None
                self._load_piece_state(exchange(state, old, new, self._groups.group, self._link.device))

    def _gather_order(self) -> list[int]:
        """The buckets in the order the first forward used them, rank 0's (every rank must gather alike)."""
        if self._order is None:
            local = self._params.gather_order()
            root = dist.get_global_rank(self._groups.group, 0)
            self._order = broadcast_int_list(local, root, self._groups.group, self._link.device)
        return self._order

    def _check_engine(self) -> None:
        self._link.check_current(self._ddp)

    # ------------------------------------------------------------------ join (uneven inputs)
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Join([ddp, optimizer]) as with torch's ``ZeroRedundancyOptimizer``; the DDP's hook does the work."""
        return JoinHook()

    def join_started(self) -> None:
        """The DDP entered a join (its join hook was made): steps share hyper-parameters from now on."""
        self._groups.join.active = True

    def _in_join(self) -> bool:
        """Inside an enabled join of the DDP (its config is that of the last Join built over it)."""
        return self._groups.join.active and self._ddp._join_config.enable

    def join_ended(self) -> None:
        self._params.wait_all()  # the DDP's post hook broadcasts parameters a gather may still write
        self._groups.join.active = False

    @property
    def join_device(self) -> torch.device:
        return self._link.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self._groups.group

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's plain per-parameter format, loadable by an unwrapped ``optimizer_class`` in one process.

        Collective: every rank must call it (it gathers every rank's shards). A rank calling it alone
        gets an error within ``state_dict_timeout_s`` naming the ranks that did not, instead of a hang.
        """
        self._check_engine()
        check_every_rank_calls(self._groups.helper, self._timeout, self._groups.rank)
        full = gather_full(self._piece_state(), self._link.layout, self._engine.params, self._groups.group)
        return to_plain(full, self.param_groups, self._index)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's plain format (from ``state_dict``, or from an unsharded optimizer); no collective."""
        full = from_plain(state_dict, self.param_groups, self._index)
        self._load_piece_state(pieces_from_full(full, self._link.layout.pieces(self._groups.rank), self._engine.params))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_finished_init", False):
            raise NotImplementedError(
                "ShardedOptimizer cannot take parameter groups after construction: the shards are laid out over "
                "the wrapper's buckets. Pass every group to the constructor (params=[{...}, {...}])."
            )
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.stage}, {self._inner!r})"
