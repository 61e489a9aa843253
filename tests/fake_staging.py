"""A fake CUDA kit for gradsync.diloco's staging on CPU: streams that check every read against the last write.

``FakeKit`` stands in for ``host_state.CudaKit`` (install it with ``install(kit)`` in the process that
builds ``DiLoCo``; a CPU "device" then takes the GPU's code path). Each stream keeps a clock: an
operation on it (``Kit.op``) gets the next tick, an event recorded on it holds the tick it was recorded
at, and a stream that waits for an event learns that the other stream got that far. An operation that
reads a tensor last written on another stream (or writes one last read there) without having waited
for an event at or after that write raises ``MissingWait``; so does the host reading a tensor whose
writing stream it has not synchronised with. ``log`` is every operation and synchronisation, in order:
(stream or "host", what, thread name).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import gradsync.diloco.host_state as host_state


class MissingWait(AssertionError):
    pass


class FakeStream:
    def __init__(self, name: str, kit: FakeKit) -> None:
        self.name = name
        self.kit = kit
        self.clock = 0
        self.seen: dict[str, int] = {}  # other stream -> the tick of it this stream has waited for

    def wait_event(self, event: FakeEvent) -> None:
        if self.name in self.kit.drop_waits_of:
            return  # the negative control: a wait the code asked for, not done
        self.seen[event.stream.name] = max(self.seen.get(event.stream.name, 0), event.tick)
        self.kit.log.append((self.name, f"waits {event.stream.name}@{event.tick}", threading.current_thread().name))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.tick = stream.clock

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        kit = self.stream.kit
        kit.host_seen[self.stream.name] = max(kit.host_seen.get(self.stream.name, 0), self.tick)
        kit.log.append(("host", f"synchronizes {self.stream.name}@{self.tick}", threading.current_thread().name))


class FakeKit:
    pin = False

    def __init__(self, drop_waits_of: Sequence[str] = ()) -> None:
        self.drop_waits_of = set(drop_waits_of)
        self.log: list[tuple[str, str, str]] = []
        self.host_seen: dict[str, int] = {}
        self._streams = {name: FakeStream(name, self) for name in ("current", "side")}
        self._current = self._streams["current"]
        self._writes: dict[int, tuple[str, int]] = {}  # storage -> (stream, tick) of its last write
        self._reads: dict[int, dict[str, int]] = {}  # storage -> stream -> tick of its last read there
        self.names: dict[int, str] = {}  # storage -> a name for the log (tests name the buffers they watch)

    def current(self) -> FakeStream:
        return self._current

    @property
    def side(self) -> FakeStream:
        return self._streams["side"]

    @contextmanager
    def using(self, stream: FakeStream) -> Iterator[None]:
        before, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = before

    def record(self, stream: FakeStream) -> FakeEvent:
        return FakeEvent(stream)

    def op(self, run: Callable[[], object], reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
        stream = self._current
        for tensor in list(reads) + list(writes):
            self._check_after_write(stream, tensor)
        for tensor in writes:
            for other, tick in self._reads.get(_key(tensor), {}).items():
                if other != stream.name and stream.seen.get(other, 0) < tick:
                    raise MissingWait(f"{stream.name} writes {self._name(tensor)} while {other} may still read it")
        run()
        stream.clock += 1
        for tensor in reads:
            self._reads.setdefault(_key(tensor), {})[stream.name] = stream.clock
        for tensor in writes:
            self._writes[_key(tensor)] = (stream.name, stream.clock)
        what = f"{[self._name(t) for t in reads]} -> {[self._name(t) for t in writes]}"
        self.log.append((stream.name, what, threading.current_thread().name))

    def host_read(self, tensor: torch.Tensor) -> None:
        last = self._writes.get(_key(tensor))
        if last is not None and self.host_seen.get(last[0], 0) < last[1]:
            raise MissingWait(f"the host reads {self._name(tensor)} before {last[0]} finished writing it")

    def _check_after_write(self, stream: FakeStream, tensor: torch.Tensor) -> None:
        last = self._writes.get(_key(tensor))
        if last is not None and last[0] != stream.name and stream.seen.get(last[0], 0) < last[1]:
            raise MissingWait(f"{stream.name} uses {self._name(tensor)} before {last[0]} finished writing it")

    def _name(self, tensor: torch.Tensor) -> str:
        return self.names.get(_key(tensor), "param")

    def ops_on(self, stream: str) -> list[str]:
        return [what for where, what, _ in self.log if where == stream and not what.startswith("waits")]


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def install(kit: FakeKit) -> Any:
    """Make DiLoCo built from now on in this process take ``kit`` for CPU parameters; returns what to restore."""
    before = host_state.kit_for
    host_state.kit_for = lambda device: kit
    return before


def name_buffers(kit: FakeKit, outer: Any) -> None:
    """Name the staging buffers in ``kit``'s log (after DiLoCo is built)."""
    staging = outer.placement.staging
    kit.names.update({_key(staging.gpu): "gpu", _key(staging.down): "down", _key(staging.up): "up"})
    for fragment in outer.fragments:
        kit.names[_key(fragment.theta)] = f"theta{fragment.index}"
