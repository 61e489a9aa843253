"""Uneven inputs: what a rank that ran out of data does while the others still train.

gradsync's DDP is a ``torch.distributed.algorithms.Joinable``, so both ``ddp.join()`` and
torch's generic ``Join([ddp, zero_optimizer])`` drive it. While any rank is still training,
torch's ``Join`` calls ``main_hook`` once per iteration on every rank that has joined; it must
issue exactly the collectives an active rank issues in one iteration, in the same order:

    active rank (DistributedDataParallel.forward + backward)    joined rank (main_hook)
    Join.notify_join_context: all_reduce(1)                      Join: all_reduce(0)
    bucket rebuild broadcast (once, before iteration 2)          same, mirrored
    buffer sync: agree on a source rank, broadcast               same, as a non-candidate
    all_reduce(this iteration syncs gradients?)                  same, contributes 0
    one collective per bucket, in bucket order                   same with zeros
    used-parameter map (find_unused_parameters)                  same with zeros

With a sharded optimizer (``gradsync.zero``) the joined rank still owns its range of every
bucket, so after the shadowed backward it steps that range with the others' average
(the reduction's ``join_partner``) and takes part in the parameters' all-gathers, as the
ranks still training do in their ``optimizer.step()``.

When every rank has joined, ``post_hook`` broadcasts the model of the last rank to join, so all
replicas end identical.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ..engine.reducer import Reducer


class Joining(Protocol):
    """What the join hook needs of the wrapper."""

    engine: Reducer
    process_group: dist.ProcessGroup
    forward_sync_buffers: bool
    require_forward_param_sync: bool

    def will_sync_module_buffers(self) -> bool: ...

    def _sync_buffers_from(self, candidate: bool) -> None: ...

    def _broadcast_module_state(self, src: int, include_buffers: bool) -> None: ...


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
    work: dist.Work = dist.all_reduce(flag, group=group, async_op=True)
    if wants_sync:
        return work  # active ranks need not wait: joined ranks are the ones asking
    work.wait()
    return bool(flag.item())


class JoinPartner(Protocol):
    """What else a joined rank shadows each synced iteration: a sharded optimizer's step."""

    def join_started(self) -> None: ...

    def shadow_step(self) -> None: ...

    def join_ended(self) -> None: ...


class DDPJoinHook(JoinHook):
    """Shadows one training iteration per ``main_hook`` call on a joined rank."""

    def __init__(self, ddp: Joining) -> None:
        self.ddp = ddp
        partner: JoinPartner | None = ddp.engine.reduction.join_partner
        if partner is not None:
            partner.join_started()

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.engine.before_forward()  # mirrors the one-time bucket rebuild
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers_from(candidate=False)
        should_sync = all_ranks_agree_to_sync(False, ddp.process_group, ddp.engine.buckets.device)
        # The next forward syncs buffers only if this iteration synced gradients.
        ddp.require_forward_param_sync = bool(should_sync)
        if should_sync:
            ddp.engine.shadow_backward()
            partner: JoinPartner | None = ddp.engine.reduction.join_partner
            if partner is not None:
                partner.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        partner: JoinPartner | None = ddp.engine.reduction.join_partner
        if partner is not None:
            partner.join_ended()  # waits for its gathers: the broadcast below writes the parameters too
        src = find_common_rank(dist.get_rank(), is_last_joiner, ddp.process_group, ddp.engine.buckets.device)
        ddp._broadcast_module_state(src, include_buffers=ddp.forward_sync_buffers)


def check_can_join(skip_all_reduce_unused_params: bool, desync_on: bool) -> None:
    if skip_all_reduce_unused_params:
        raise RuntimeError(
            "skip_all_reduce_unused_params cannot be combined with join: a joined rank does not know "
            "which buckets the ranks still training skip, so their collectives would not match. "
            "Construct DistributedDataParallel without skip_all_reduce_unused_params to use join."
        )
    if desync_on:
        raise RuntimeError(
            "Desync detection cannot be combined with join: joined ranks deliberately issue "
            "different collectives than the ranks still training. Disable one of them."
        )


def check_forward_collectives(modules: list[str], throw_on_early_termination: bool) -> None:
    """Modules that communicate inside forward cannot be shadowed by joined ranks."""
    if modules and not throw_on_early_termination:
        raise RuntimeError(
            f"Modules {modules} communicate inside forward (SyncBatchNorm), which ranks "
            "that already joined cannot mirror, so training would hang. Use "
            "join(throw_on_early_termination=True) and stop every rank once one runs out of data."
        )
