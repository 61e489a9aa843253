"""The stream current on one device, told apart in a fraction of a microsecond.

The engine asks which stream is current in every gradient hook ([Note: stream order] in
engine/streams.py) and the CUDA clock at every event it records. ``torch.cuda.current_stream(device)``
builds a new ``Stream`` object each time: about 5 us on an H200's host (measured by
benchmarks/studies/gpu_host_profile.py), 0.8 ms a step for GPT-2 small's 148 parameters, which is most
of what a step at batch 1 x 1024 can spare. ``torch._C._cuda_getCurrentRawStream(index)`` returns
the ``cudaStream_t`` as an int in about 0.2 us: it is the call torch.compile's generated code makes
for the same purpose, and where a torch lacks it the public ``Stream.cuda_stream`` gives the same
int. That int names the stream for the life of the process (pool streams are never destroyed; an
external stream is its pointer), so the ``Stream`` object for it is made once and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

KNOWN_STREAMS_MAX = 64  # more distinct streams than this (external ones made anew?): start the cache over


class CurrentStream:
    """``key()``: a hashable name of the current stream; ``stream()``: the stream object itself.

    ``current_stream(device)`` is for tests without a GPU: a callable returning fake streams, each its
    own key. Without it, ``device`` must be a CUDA device.
    """

    __slots__ = ("device", "key", "_make", "_known")

    def __init__(self, device: torch.device, current_stream: Callable[[torch.device], Any] | None = None) -> None:
        self.device = device
        self._known: dict[Hashable, Any] = {}
        if current_stream is not None:
            self.key: Callable[[], Hashable] = lambda: current_stream(device)
            self._make: Callable[[], Any] = lambda: current_stream(device)
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._make = lambda: torch.cuda.current_stream(index)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self.key = (lambda: raw(index)) if raw is not None else (lambda: self._make().cuda_stream)

    def stream(self, key: Hashable | None = None) -> Any:
        """The current stream's object; ``key``, if given, must be what ``key()`` just returned."""
        if key is None:
            key = self.key()
        stream = self._known.get(key)
        if stream is None:
            if len(self._known) >= KNOWN_STREAMS_MAX:
                self._known.clear()
            stream = self._known[key] = self._make()
        return stream
