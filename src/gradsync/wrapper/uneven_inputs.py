"""Uneven inputs: what a rank that ran out of data does while the others still train.

gradsync's DDP is a ``torch.distributed.algorithms.Joinable``, so both ``ddp.join()``
and torch's generic ``Join([ddp, zero_optimizer])`` drive it. While any rank is still
training, torch's ``Join`` calls ``main_hook`` once per iteration on every rank that
has joined; it must issue exactly the collectives an active rank issues in one
iteration, in the same order:

    active rank (DistributedDataParallel.forward + backward)    joined rank (main_hook)
    Join.notify_join_context: all_reduce(1)                      Join: all_reduce(0)
    bucket rebuild broadcast (once, before iteration 2)          same, mirrored
    buffer sync: agree on a source rank, broadcast               same, as a non-candidate
    all_reduce(this iteration syncs gradients?)                  same, contributes 0
    one collective per bucket, in bucket order                   same with zeros
    used-parameter map (find_unused_parameters)                  same with zeros

When every rank has joined, ``post_hook`` broadcasts the model of the last rank to
join, so all replicas end identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..engine.grad_bucket import GradBucket
from ..engine.launch import finish_hook_launches

if TYPE_CHECKING:
    from ..ddp import DistributedDataParallel
    from ..engine.reducer import Reducer


def find_common_rank(rank: int, candidate: bool, group: dist.ProcessGroup, device: torch.device) -> int:
    """The largest global rank among the candidates (every rank must call this)."""
    value = torch.tensor([rank if candidate else -1], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    common = int(value.item())
    if common < 0:
        raise RuntimeError("gradsync join: no rank volunteered as the source of module state")
    return common


def all_ranks_agree_to_sync(wants_sync: bool, group: dist.ProcessGroup, device: torch.device) -> dist.Work | bool:
    """Whether any rank syncs gradients this iteration; joined ranks wait for the answer."""
    flag = torch.tensor([1 if wants_sync else 0], device=device)
    work = dist.all_reduce(flag, group=group, async_op=True)
    if wants_sync:
        return work  # active ranks need not wait: joined ranks are the ones asking
    work.wait()
    return bool(flag.item())


def shadow_reduce(reducer: Reducer) -> None:
    """A joined rank's part of one synced backward: every bucket, in order, with zeros."""
    pending = []
    count = len(reducer.buckets.storages)
    for b, storage in enumerate(reducer.buckets.storages):
        zeros = reducer.buckets.zeros_like_bucket(b)
        if reducer.comm_hook is None:
            pending.append(dist.all_reduce(zeros, group=reducer.process_group, async_op=True))
        else:
            bucket = GradBucket(b, zeros, storage, b == count - 1)
            pending.append(reducer.comm_hook(reducer.comm_hook_state, bucket))
    finish_hook_launches(reducer.comm_hook_state)
    if reducer.find_unused or (reducer.static_graph and reducer.iteration == 0):
        used = torch.zeros(len(reducer.params), dtype=torch.int32, device=reducer.buckets.device)
        pending.append(dist.all_reduce(used, group=reducer.process_group, async_op=True))
    for work in pending:
        work.wait()
    reducer.iteration += 1


class DDPJoinHook(JoinHook):
    """Shadows one training iteration per ``main_hook`` call on a joined rank."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.ddp._join_divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.prepare_for_forward()  # mirrors the one-time bucket rebuild
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers(candidate=False)
        should_sync = all_ranks_agree_to_sync(False, ddp.process_group, ddp.reducer.buckets.device)
        # The next forward syncs buffers only if this iteration synced gradients.
        ddp.require_forward_param_sync = bool(should_sync)
        if should_sync:
            shadow_reduce(ddp.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = find_common_rank(dist.get_rank(), is_last_joiner, ddp.process_group, ddp.reducer.buckets.device)
        ddp._broadcast_module_state(src, include_buffers=ddp.forward_sync_buffers)


class JoinableDDP(Joinable):
    """The ``Joinable`` side of ``DistributedDataParallel``: ``ddp.join()`` and torch's generic ``Join``."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for ranks with different numbers of batches (see ``join.py``).

        Ranks that run out of data shadow the collectives of those still training;
        with ``divide_by_initial_world_size=False`` gradients are averaged over the
        ranks still active instead of the whole group.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def _check_join_allows_forward_collectives(self) -> None:
        if not self._join_config.throw_on_early_termination:
            raise RuntimeError(
                f"Modules {self._forward_collectives} communicate inside forward (SyncBatchNorm), which ranks "
                "that already joined cannot mirror, so training would hang. Use "
                "join(throw_on_early_termination=True) and stop every rank once one runs out of data."
            )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        if self.skip_all_reduce_unused_params:
            raise RuntimeError(
                "skip_all_reduce_unused_params cannot be combined with join: a joined rank does not know "
                "which buckets the ranks still training skip, so their collectives would not match. "
                "Construct DistributedDataParallel without skip_all_reduce_unused_params to use join."
            )
        if self.reducer.desync is not None:
            raise RuntimeError(
                "Desync detection cannot be combined with join: joined ranks deliberately issue "
                "different collectives than the ranks still training. Disable one of them."
            )
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.reducer.buckets.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group
