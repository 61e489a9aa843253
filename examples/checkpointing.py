"""Checkpoints for the digits example: written atomically, checksummed, the last two kept.

Used by ``train_digits.py --checkpoint-dir DIR``; docs/checkpointing.md explains the scheme.

[Note: checkpoint file format]
One file per checkpoint, named after the global step it was taken after
(``step-00000020.ckpt``): a one-line ASCII header, then the payload::

    GRADSYNC-CKPT 1 <sha256 of the payload, hex> <payload length in bytes>\\n
    <payload: torch.save() of a dict of tensors, numbers, strings, lists and tuples>

A file whose length or checksum does not match its header is corrupt (a write cut short,
a flipped bit on disk) and is never loaded: ``newest_valid`` skips it and tries the next
older one. The payload is loaded with ``weights_only=True``, so a checkpoint cannot run code.

[Note: atomic write]
Rank 0 writes to a temporary file in the checkpoint directory, flushes and fsyncs it,
renames it over the final name (``os.replace`` is atomic within one file system) and fsyncs
the directory so the rename itself survives a power cut. A reader therefore sees either
the old set of checkpoints or the new one, never half a file under a final name. A crash
mid-write leaves only a ``.tmp`` file, which the next ``load`` removes.

[Note: who reads and writes]
Only rank 0 touches the directory. ``save`` gathers every rank's own state (its RNG
streams) to rank 0 and then broadcasts the outcome, so no rank goes on before the
checkpoint exists (or all of them raise). ``load`` has rank 0 choose and read the
checkpoint and broadcasts it, so every rank resumes from the same one even if they would
see the directory differently (a node-local disk, a lagging network file system).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

MAGIC = "GRADSYNC-CKPT"
VERSION = 1
KEEP = 2  # checkpoints kept on disk: the newest, and one to fall back to if it is corrupt
SUFFIX = ".ckpt"


class CorruptCheckpoint(Exception):
    """A checkpoint file that must not be loaded; the message says why."""


class Loaded(NamedTuple):
    """What ``load`` found: the state (None: start from scratch), its file, the files skipped."""

    state: dict[str, Any] | None
    path: Path | None
    rejected: list[tuple[Path, str]]  # (file, why it was not used), newest first


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}{SUFFIX}"


def encode(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = f"{MAGIC} {VERSION} {hashlib.sha256(payload).hexdigest()} {len(payload)}\n"
    return header.encode("ascii") + payload


def decode(data: bytes) -> dict[str, Any]:
    """The state in ``data``; ``CorruptCheckpoint`` if the header, length or checksum is off."""
    header, newline, payload = data.partition(b"\n")
    fields = header.decode("ascii", errors="replace").split(" ")
    if not newline or len(fields) != 4 or fields[0] != MAGIC or fields[1] != str(VERSION):
        raise CorruptCheckpoint(f"no '{MAGIC} {VERSION}' header")
    digest, length = fields[2], fields[3]
    if str(len(payload)) != length:
        raise CorruptCheckpoint(f"payload is {len(payload)} bytes, the header says {length} (truncated?)")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptCheckpoint("sha256 of the payload does not match the header")
    return torch.load(io.BytesIO(payload), weights_only=True)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` afterwards, or is untouched: see [Note: atomic write]."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            os.fchmod(tmp.fileno(), 0o644)  # mkstemp makes it private; a checkpoint need not be
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, newest (highest step) first."""
    steps = {}
    for path in directory.glob(f"step-*{SUFFIX}"):
        step = path.name[len("step-") : -len(SUFFIX)]
        if step.isdigit():
            steps[path] = int(step)
    return sorted(steps, key=steps.__getitem__, reverse=True)


def newest_valid(directory: Path) -> Loaded:
    """The newest checkpoint that decodes; corrupt ones are renamed ``*.corrupt`` and skipped.

    Only a failed header, length or checksum counts as corrupt. A file that passes them and
    still does not load (a newer format, a type ``weights_only`` refuses) raises: falling
    back would silently throw away training.
    """
    rejected = []
    for path in checkpoints(directory):
        try:
            return Loaded(decode(path.read_bytes()), path, rejected)
        except CorruptCheckpoint as error:
            # Renamed, not deleted: kept for a post-mortem, and out of the way of the rotation.
            path.replace(path.with_name(path.name + ".corrupt"))
            rejected.append((path, str(error)))
    return Loaded(None, None, rejected)


def prune(directory: Path, keep: int = KEEP) -> None:
    for path in checkpoints(directory)[keep:]:
        path.unlink(missing_ok=True)


def _on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` run on rank 0, its result on every rank; if it raised, every rank raises.

    Without the broadcast of the failure, the other ranks would wait in the next
    collective until the process group's timeout.
    """
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            failure, box = error, [(False, f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise RuntimeError(f"rank 0 could not {what}: {value}") from failure
    return value


def save(directory: Path, step: int, shared: dict[str, Any], local: dict[str, Any]) -> Path:
    """Collective: checkpoint ``shared`` (rank 0's) plus every rank's ``local`` state.

    ``local`` lands in the file's ``ranks`` list at the rank's index. Returns on every rank
    only once rank 0 has written the file; raises on every rank if rank 0 could not.
    """
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    path = checkpoint_path(directory, step)

    def write() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, encode({**shared, "ranks": gathered}))
        prune(directory)

    _on_rank0(write, f"write checkpoint {path}")
    return path


def load(directory: Path) -> Loaded:
    """Collective: the newest valid checkpoint in ``directory``, the same on every rank."""

    def find() -> Loaded:
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(".*.tmp"):  # a write cut short: never renamed, never valid
            leftover.unlink(missing_ok=True)
        return newest_valid(directory)

    return _on_rank0(find, f"load a checkpoint from {directory}")
