"""Optimizer state per piece: moved to a new shard layout, gathered into torch's per-parameter format, loaded from it.

[Note: state per piece]
The inner optimizer steps one tensor per ``Piece`` (the part of a parameter in this rank's range of
a bucket). Its state splits the same way: *elementwise* tensors (Adam's ``exp_avg``, SGD's
``momentum_buffer``) have the piece's length, *scalar* state (``step``, NAdam's ``mu_product``)
is the parameter's, the same in every piece of it. So

- after the bucket rebuild, ``exchange`` sends every element's state from its old owner to its new
  one: one ``all_to_all_single`` per elementwise key, plus one ``all_gather_object`` of the scalars
  and key names; each rank holds only its shard's worth at any time;
- ``gather_full`` builds torch's plain per-parameter state (full tensors shaped like the
  parameters) on every rank: one ``all_gather`` per bucket and key;
- ``pieces_from_full`` cuts a plain state back into this rank's pieces, with no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.sharded import start_all_gather
from ..engine.sharding import Piece, ShardLayout, memory_order

PieceState = dict[Piece, dict[str, Any]]


def _is_elementwise(value: Any, piece: Piece) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.length


class StateMetadata:
    """Per parameter with state: its scalar state, and its elementwise keys with their dtypes."""

    def __init__(self) -> None:
        self.scalars: dict[int, dict[str, Any]] = {}
        self.elementwise: dict[int, dict[str, torch.dtype]] = {}

    @classmethod
    def of(cls, state: PieceState) -> StateMetadata:
        meta = cls()
        for piece, values in state.items():
            scalars = meta.scalars.setdefault(piece.param, {})
            keys = meta.elementwise.setdefault(piece.param, {})
            for key, value in values.items():
                if _is_elementwise(value, piece):
                    keys[key] = value.dtype
                elif key not in scalars:
                    scalars[key] = _clone(value)
        return meta

    def merge(self, other: StateMetadata) -> None:
        for param, scalars in other.scalars.items():
            self.scalars.setdefault(param, scalars)
        for param, keys in other.elementwise.items():
            self.elementwise.setdefault(param, {}).update(keys)

    def keys(self) -> dict[str, torch.dtype]:
        every: dict[str, torch.dtype] = {}
        for keys in self.elementwise.values():
            every.update(keys)
        return dict(sorted(every.items()))


def _agree(state: PieceState, group: dist.ProcessGroup) -> StateMetadata:
    """Every parameter's scalar state and elementwise keys, from whichever ranks hold it."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, StateMetadata.of(state), group=group)
    meta = StateMetadata()
    for theirs in every:
        meta.merge(theirs)
    return meta


def _overlaps(
    sender: list[Piece], receiver: list[Piece], meta: StateMetadata, key: str
) -> list[tuple[Piece, Piece, int, int]]:
    """(sender piece, receiver piece, first element, length) of every shared range of a parameter with
    elementwise state ``key``, in (parameter, element) order: both ranks of a pair compute the same list."""
    by_param: dict[int, list[Piece]] = {}
    for piece in receiver:
        if key in meta.elementwise.get(piece.param, ()):
            by_param.setdefault(piece.param, []).append(piece)
    shared = []
    for old in sender:
        for new in by_param.get(old.param, ()):
            lo = max(old.param_start, new.param_start)
            hi = min(old.param_start + old.length, new.param_start + new.length)
            if lo < hi:
                shared.append((old, new, lo, hi - lo))
    shared.sort(key=lambda item: (item[0].param, item[2]))
    return shared


def exchange(
    state: PieceState, old: ShardLayout, new: ShardLayout, group: dist.ProcessGroup, device: torch.device
) -> PieceState:
    """This rank's state for its pieces of ``new``, from every rank's pieces of ``old`` ([Note: state per piece]).

    ``state`` is consumed: each key's tensors are dropped once they are in the send buffer, so at most
    one key travels at a time (its send and receive buffers) beside the keys already moved.
    """
    world = dist.get_world_size(group)
    return exchange_pieces(state, [old.pieces(r) for r in range(world)], [new.pieces(r) for r in range(world)], group,
                           device)  # fmt: skip


def exchange_pieces(
    state: PieceState,
    old_pieces: list[list[Piece]],
    new_pieces: list[list[Piece]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> PieceState:
    """``exchange`` between any two assignments of pieces to the ranks of ``group`` (by group rank): a rank
    may own nothing in one of them (the members of a live island send, a restarted island's receive)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    meta = _agree(state, group)
    result: PieceState = {
        p: {k: _clone(v) for k, v in meta.scalars[p.param].items()} for p in new_pieces[rank] if p.param in meta.scalars
    }
    for key, dtype in meta.keys().items():
        sends = [_overlaps(old_pieces[rank], new_pieces[d], meta, key) for d in range(world)]
        receives = [_overlaps(old_pieces[s], new_pieces[rank], meta, key) for s in range(world)]
        send = [state[o][key].narrow(0, lo - o.param_start, n) for d in range(world) for o, _, lo, n in sends[d]]
        outgoing = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        del send
        for values in state.values():
            values.pop(key, None)
        recv_sizes = [sum(item[3] for item in receives[s]) for s in range(world)]
        incoming = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        send_sizes = [sum(item[3] for item in sends[d]) for d in range(world)]
        dist.all_to_all_single(incoming, outgoing, recv_sizes, send_sizes, group=group)
        del outgoing
        at = 0
        for s in range(world):
            for _, piece, lo, n in receives[s]:
                target = result[piece].setdefault(key, torch.zeros(piece.length, dtype=dtype, device=device))
                target.narrow(0, lo - piece.param_start, n).copy_(incoming.narrow(0, at, n))
                at += n
        del incoming  # before the next key's send buffer exists
    return result


def gather_full(
    state: PieceState, layout: ShardLayout, params: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> dict[int, dict[str, Any]]:
    """torch's per-parameter state (engine index -> {key: value}), full tensors, on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    meta = _agree(state, group)
    full = {i: {k: _clone(v) for k, v in values.items()} for i, values in meta.scalars.items()}
    device = params[0].device
    every_rank = [layout.pieces(r) for r in range(world)]
    for key, dtype in meta.keys().items():
        for b, shard_numel in enumerate(layout.shard_numel):
            shard = torch.zeros(shard_numel, dtype=dtype, device=device)
            for piece in every_rank[rank]:
                if piece.bucket == b and key in state.get(piece, {}):
                    shard.narrow(0, piece.shard_start, piece.length).copy_(state[piece][key])
            gathered = torch.empty(layout.padded[b], dtype=dtype, device=device)
            start_all_gather(gathered, shard, group).wait()
            for r, pieces in enumerate(every_rank):
                for piece in pieces:
                    if piece.bucket != b or key not in meta.elementwise.get(piece.param, ()):
                        continue
                    values = full[piece.param]
                    if key not in values:
                        values[key] = torch.zeros_like(params[piece.param], dtype=dtype)
                    source = gathered.narrow(0, r * shard_numel + piece.shard_start, piece.length)
                    memory_order(values[key]).narrow(0, piece.param_start, piece.length).copy_(source)
    return full


def pieces_from_full(
    full: dict[int, dict[str, Any]], pieces: list[Piece], params: Sequence[torch.Tensor]
) -> PieceState:
    """This rank's pieces of torch's per-parameter state (no collective)."""
    state: PieceState = {}
    for piece in pieces:
        values = full.get(piece.param)
        if values is None:
            continue
        mine = state[piece] = {}
        for key, value in values.items():
            param = params[piece.param]
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                aligned = torch.empty_like(param, dtype=value.dtype).copy_(value)  # the parameter's memory order
                mine[key] = memory_order(aligned).narrow(0, piece.param_start, piece.length).clone()
            else:
                mine[key] = _clone(value)
    return state


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
