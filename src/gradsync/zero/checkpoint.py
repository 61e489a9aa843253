"""Sharded checkpoints of a ``ShardedOptimizer`` and its model with ``torch.distributed.checkpoint``.

    gradsync.zero.save_sharded("ckpt/step_1000", ddp, optimizer, extra={"step": 1000})
    ...                                                # later, at any world size
    extra = gradsync.zero.load_sharded("ckpt/step_1000", ddp, optimizer)

Both are collective over the wrapper's process group, and the directory must be one every rank
sees (a shared file system). No state is gathered (DCP gathers only its save plans): each rank
writes the pieces of optimizer state it owns and reads back only the saved chunks that overlap the
pieces it owns now, whatever the world size and bucket layout either time.

[Note: the checkpoint's keys]
One flat ``torch.distributed.checkpoint`` state dict, its keys readable in the metadata:

- ``model.<key>``: ``ddp.module.state_dict()``, the same on every rank; DCP writes each key once
  (its save plan drops the replicas, spreading what is left over the ranks).
- ``optim.param_groups``: the param groups' hyper-parameters, ``params`` as parameter *names*.
- ``optim.params.<name>``: per parameter with state, its ``numel``, its scalar state (``step``)
  and the names of its elementwise keys; written by every rank holding a piece of it (the same
  values, so once).
- ``optim.state.<name>.<key>.<start>-<stop>``: elements ``[start, stop)`` of elementwise state
  ``key`` (``exp_avg``) of the parameter, in the parameter's memory order ([Note: state per
  piece] in state_exchange.py): one 1-D tensor per piece, written by the rank that owns it.
- ``extra``: the caller's object (the same on every rank; LR scheduler, epoch, data position).

A load reads the metadata and the small entries first and checks, on every rank alike, that the
chunks of every parameter and key tile the whole parameter; only then does each rank read the
chunks overlapping its pieces (a chunk is read whole, so at either end of a piece up to one saved
piece more) and cuts its pieces out of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from os import PathLike
from typing import Any, Union

import torch
import torch.distributed.checkpoint as dcp

from ..engine.sharding import Piece
from ..wrapper.data_parallel import DataParallelWrapper
from .sharded_optimizer import ShardedOptimizer
from .state_exchange import PieceState

MODEL = "model."
GROUPS = "optim.param_groups"
ENTRY = "optim.params."
STATE = "optim.state."
EXTRA = "extra"
_RANGE = re.compile(r"(?P<name_key>.+)\.(?P<start>\d+)-(?P<stop>\d+)")

Chunks = dict[tuple[str, str], list[tuple[int, int, str]]]  # (parameter, key) -> [(start, stop, dcp key)]
Path = Union[str, PathLike[str]]


def save_sharded(path: Path, ddp: DataParallelWrapper, optimizer: ShardedOptimizer, extra: Any = None) -> None:
    """Write ``ddp``'s module and ``optimizer``'s shards to the directory ``path`` ([Note: the checkpoint's keys]).

    Collective: every rank of ``ddp``'s process group must call it, with the same ``path`` on a
    file system all of them see and the same ``extra`` (any picklable object, or tensors).
    Each rank writes only its own pieces of the optimizer state; the model is written once.
    """
    _check_pair(ddp, optimizer)
    optimizer.wait_for_params()
    state: dict[str, Any] = {MODEL + key: value for key, value in ddp.module.state_dict().items()}
    state[GROUPS] = _named_groups(optimizer)
    state.update(_own_pieces(optimizer))
    if extra is not None:
        state[EXTRA] = extra
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(path),
        planner=dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        process_group=ddp.process_group,
    )


def load_sharded(path: Path, ddp: DataParallelWrapper, optimizer: ShardedOptimizer) -> Any:
    """Load a ``save_sharded`` checkpoint into ``ddp``'s module and ``optimizer``; the saved ``extra``.

    Collective: every rank of ``ddp``'s process group must call it. The world size, the bucket
    layout and ``stage`` may differ from the saving run's; the model and the param groups (their
    parameter names) must be the same. The weights are copied into the existing parameters; each
    rank reads only the saved chunks of optimizer state that overlap its pieces. A checkpoint that
    lacks a parameter, or part of one's state, raises ``ValueError`` naming it, on every rank,
    before anything is loaded.
    """
    _check_pair(ddp, optimizer)
    optimizer.wait_for_params()
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    small: dict[str, Any] = {key: None for key in saved if key in (GROUPS, EXTRA) or key.startswith(ENTRY)}
    if GROUPS not in small:
        raise ValueError(f"{path} is not a gradsync.zero.save_sharded checkpoint: it has no {GROUPS!r}.")
    _load(path, small, ddp)
    entries = {key[len(ENTRY) :]: value for key, value in small.items() if key.startswith(ENTRY)}
    model = ddp.module.state_dict(keep_vars=True)  # the live parameters and buffers: loaded in place
    _check_model(path, saved, model)
    _check_groups(path, small[GROUPS], optimizer)
    chunks = _check_chunks(path, saved, entries, optimizer)
    wanted = _overlapping(saved, chunks, entries, optimizer)
    request = {MODEL + key: value for key, value in model.items()}  # tensors copied into; other values replaced
    request.update(wanted)
    with torch.no_grad():
        _load(path, request, ddp)
    objects = {key: request[MODEL + key] for key, value in model.items() if not isinstance(value, torch.Tensor)}
    if objects:  # get_extra_state() values: the modules' set_extra_state takes them
        ddp.module.load_state_dict(objects, strict=False)
    for group, mine in zip(small[GROUPS], optimizer.param_groups):
        mine.update({key: value for key, value in group.items() if key != "params"})
    optimizer._load_piece_state(_assemble(chunks, entries, wanted, optimizer))
    return small.get(EXTRA)


# ------------------------------------------------------------------ saving
def _named_groups(optimizer: ShardedOptimizer) -> list[dict[str, Any]]:
    names = {id(p): n for p, n in zip(optimizer._engine.params, optimizer._engine.names)}
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def _own_pieces(optimizer: ShardedOptimizer) -> dict[str, Any]:
    """This rank's chunks, and an entry for every parameter it holds a piece of that has state."""
    names, params = optimizer._engine.names, optimizer._engine.params
    out: dict[str, Any] = {}
    for piece, values in optimizer._piece_state().items():
        name = names[piece.param]
        stop = piece.param_start + piece.length
        scalars, elementwise = {}, []
        for key, value in sorted(values.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.length:
                out[f"{STATE}{name}.{key}.{piece.param_start}-{stop}"] = value
                elementwise.append(key)
            else:
                scalars[key] = value
        out[ENTRY + name] = {"numel": params[piece.param].numel(), "scalars": scalars, "elementwise": elementwise}
    return out


# ------------------------------------------------------------------ loading
def _load(path: Path, state: dict[str, Any], ddp: DataParallelWrapper) -> None:
    """``dcp.load`` into ``state`` as it is: tensors copied into, other values replaced."""
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(path),
        planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        process_group=ddp.process_group,
    )


def _check_model(path: Path, saved: Mapping[str, Any], model: dict[str, Any]) -> None:
    have = {key[len(MODEL) :] for key in saved if key.startswith(MODEL)}
    missing = [key for key in model if key not in have]
    unexpected = sorted(have - set(model))
    shapes = {key: tuple(getattr(saved[MODEL + key], "size", ())) for key in model if key in have}
    resized = [
        f"{key} (saved {shapes[key]}, here {tuple(value.shape)})"
        for key, value in model.items()
        if key in have and isinstance(value, torch.Tensor) and shapes[key] != tuple(value.shape)
    ]
    named = (("missing from it", missing), ("not in this model", unexpected))
    problems = [f"{what}: {keys}" for what, keys in named if keys]
    problems += [f"other shapes: {resized}"] if resized else []
    if problems:
        raise ValueError(
            f"The checkpoint at {path} does not hold this model's weights ({'; '.join(problems)}). Load it into "
            "the model it was saved from."
        )


def _check_groups(path: Path, groups: list[dict[str, Any]], optimizer: ShardedOptimizer) -> None:
    ours = _named_groups(optimizer)
    if [g["params"] for g in groups] == [g["params"] for g in ours]:
        return
    saved_names = {n for g in groups for n in g["params"]}
    our_names = {n for g in ours for n in g["params"]}
    missing, unexpected = sorted(our_names - saved_names), sorted(saved_names - our_names)
    detail = f"parameters {missing} are not in the checkpoint" if missing else ""
    detail += ("; " if detail and unexpected else "") + (
        f"it has parameters {unexpected} this optimizer lacks" if unexpected else ""
    )
    raise ValueError(
        f"The checkpoint at {path} has other param groups than this optimizer: "
        f"{detail or 'the same parameters, grouped or ordered differently'}. Build the ShardedOptimizer with the "
        "param groups it was saved with."
    )


def _check_chunks(path: Path, saved: Mapping[str, Any], entries: dict[str, Any], optimizer: ShardedOptimizer) -> Chunks:
    """Every (parameter, key) of ``entries``: its saved chunks, sorted; they must tile the parameter."""
    numel = {n: p.numel() for n, p in zip(optimizer._engine.names, optimizer._engine.params)}
    strangers = sorted(name for name in entries if name not in numel)
    if strangers:
        raise ValueError(
            f"The checkpoint at {path} has optimizer state for parameters {strangers} this optimizer lacks."
        )
    found: dict[str, list[tuple[int, int, str]]] = {}
    for key in saved:
        match = _RANGE.fullmatch(key[len(STATE) :]) if key.startswith(STATE) else None
        if match:
            found.setdefault(match["name_key"], []).append((int(match["start"]), int(match["stop"]), key))
    chunks: Chunks = {}
    for name, entry in sorted(entries.items()):
        if entry["numel"] != numel[name]:
            raise ValueError(
                f"Parameter {name!r} has {numel[name]} elements, {entry['numel']} in the checkpoint at {path}."
            )
        for key in entry["elementwise"]:
            ranges = chunks[name, key] = sorted(found.pop(f"{name}.{key}", []))
            _check_tiling(path, name, key, ranges, numel[name])
    if found:
        raise ValueError(
            f"The checkpoint at {path} has optimizer state chunks {sorted(found)} with no entry {ENTRY}<name> "
            "saying what they belong to: it was written incompletely."
        )
    return chunks


def _check_tiling(path: Path, name: str, key: str, ranges: list[tuple[int, int, str]], numel: int) -> None:
    at = 0
    for start, stop, _ in ranges + [(numel, numel, "")]:
        if start != at:
            what = f"elements {at}-{start} are missing" if start > at else f"elements {start}-{at} are saved twice"
            raise ValueError(
                f"The checkpoint at {path} does not cover the optimizer state {key!r} of parameter {name!r}: {what} "
                f"(saved ranges {[(a, b) for a, b, _ in ranges]} of {numel}). It was written incompletely, or by "
                "another model."
            )
        at = stop


def _overlapping(
    saved: Mapping[str, Any], chunks: Chunks, entries: dict[str, Any], optimizer: ShardedOptimizer
) -> dict[str, torch.Tensor]:
    """An empty tensor for every saved chunk that overlaps one of this rank's pieces."""
    device = optimizer._engine.buckets.device
    wanted = {}
    for piece in optimizer._pieces:
        for _, start, stop, dcp_key in _overlaps(piece, chunks, entries, optimizer):
            if dcp_key not in wanted:
                wanted[dcp_key] = torch.empty(stop - start, dtype=saved[dcp_key].properties.dtype, device=device)
    return wanted


def _overlaps(
    piece: Piece, chunks: Chunks, entries: dict[str, Any], optimizer: ShardedOptimizer
) -> list[tuple[str, int, int, str]]:
    """(state key, chunk start, chunk stop, dcp key) of the chunks overlapping ``piece``."""
    name = optimizer._engine.names[piece.param]
    stop = piece.param_start + piece.length
    entry = entries.get(name)
    found = []
    for key in entry["elementwise"] if entry else ():
        found += [(key, a, b, k) for a, b, k in chunks[name, key] if a < stop and piece.param_start < b]
    return found


def _assemble(
    chunks: Chunks, entries: dict[str, Any], loaded: dict[str, torch.Tensor], optimizer: ShardedOptimizer
) -> PieceState:
    """This rank's piece state, cut out of the loaded chunks."""
    state: PieceState = {}
    for piece in optimizer._pieces:
        entry = entries.get(optimizer._engine.names[piece.param])
        if entry is None:
            continue  # never stepped (no gradient yet): no state, as in torch
        values = state[piece] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry["scalars"].items()
        }
        start, stop = piece.param_start, piece.param_start + piece.length
        for key, a, b, dcp_key in _overlaps(piece, chunks, entries, optimizer):
            chunk = loaded[dcp_key]
            if key not in values:
                values[key] = torch.empty(piece.length, dtype=chunk.dtype, device=chunk.device)
            lo, hi = max(a, start), min(b, stop)
            values[key].narrow(0, lo - start, hi - lo).copy_(chunk.narrow(0, lo - a, hi - lo))
    return state


def _check_pair(ddp: DataParallelWrapper, optimizer: ShardedOptimizer) -> None:
    if not isinstance(optimizer, ShardedOptimizer):
        raise TypeError(
            f"save_sharded/load_sharded take a gradsync.zero.ShardedOptimizer, got {type(optimizer).__name__}; for "
            "plain DDP and an unsharded optimizer, save ddp.state_dict() and optimizer.state_dict() from rank 0."
        )
    if optimizer._ddp is not ddp:
        raise ValueError("This ShardedOptimizer was built over another DistributedDataParallel than the one passed.")
    optimizer._check_engine()
