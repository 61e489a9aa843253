"""Stream order on CUDA: a bucket is copied in and launched only after every stream that produced one
of its gradients.

[Note: stream order]
On CUDA each gradient hook runs on the stream autograd chose for the parameter's AccumulateGrad node
(``Engine::evaluate_function`` sets the node's stream around its hooks), so in the hook ``.grad`` is
ready *on that stream*. A bucket is copied into its flat buffer, and its collective launched, from the
hook that completes it, on that hook's stream; NCCL's stream waits for the stream current at launch
(``ProcessGroupNCCL::collective``'s [Sync Streams]) and for nothing else. When the bucket's other
gradients were produced on other streams (two branches on two side streams, user streams around parts
of the forward, torch.compile's copies: DeepSpeed #8061) the copy would read them before they are
written: wrong averages with no error. torch's C++ reducer has this hole too (its TODO in
``Reducer::all_reduce_bucket``).

So each hook notes its current stream, per bucket, and the launch makes the launching stream wait
(``wait_stream``: an event on the GPU, no host synchronisation) for every noted stream that is not
itself. With one stream, the common case, nothing is waited for: a comparison per bucket. The stream
is told by an int (``CurrentStream.key``, gradsync/cuda/current_stream.py), not by building a
``Stream`` object in every hook, which cost a few percent of a host-bound step.

Which stream a hook runs on depends on who holds the parameter's AccumulateGrad node. A node nobody
holds is made again in every forward, on the stream current there, so hooks follow the forward's
streams and this order is what keeps a bucket correct. A held node keeps the stream current when it
was made: torch's DDP holds them from its constructor (#137483: build it on the stream you train on).
On a GPU gradsync's reducer holds them only once the RPC framework runs (distributed autograd
needs hooks on them: ``DistributedBackwards`` in autograd_context.py; a CPU module's are held from
the start). Then every hook runs on the stream current when they were taken, autograd makes it wait
for the stream that computed each gradient, and the waits here find nothing to do; they still guard
a bucket launched from another stream (the end of backward, on the caller's).

The end of backward needs nothing from here: autograd runs the final callback, gradsync's finalize,
on the caller's stream after making it wait for every leaf stream ([Note: Streaming backwards] in
torch's engine), and ``work.wait()`` / a CUDA future's ``wait()`` make that stream wait for the
reduction, so the averages are copied back on the caller's stream after the reduction.

Only a CUDA reducer holds a ``StreamOrder`` (``stream_order_for``); on CPU the reducer holds None and
its hot path pays one ``is None`` check.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from gradsync.cuda.current_stream import CurrentStream

CurrentStreamFn = Callable[[torch.device], Any]


class StreamOrder:
    """Which streams produced each bucket's gradients in this backward, and the waits its launch needs.

    ``current_stream(device)`` is for tests without a GPU (anything with ``wait_stream`` will do as a
    stream); otherwise the current stream is told by ``CurrentStream``'s cheap key.
    """

    __slots__ = ("device", "current", "_bucket_of", "_producers", "waits")

    def __init__(self, device: torch.device, current_stream: CurrentStreamFn | None = None) -> None:
        self.device = device
        self.current = CurrentStream(device, current_stream)
        self._bucket_of: Sequence[int] = ()
        self._producers: list[dict[Hashable, Any]] = []  # per bucket: the streams its hooks ran on, by key
        self.waits = 0  # wait_stream calls so far (tests: none when everything ran on one stream)

    def begin_pass(self, bucket_of: Sequence[int], num_buckets: int) -> None:
        """A new backward (or new buckets): nothing noted yet."""
        self._bucket_of = bucket_of
        self._producers = [{} for _ in range(num_buckets)]

    def note(self, index: int) -> None:
        """Parameter ``index``'s gradient was accumulated on the current stream (called from its hook)."""
        key = self.current.key()
        seen = self._producers[self._bucket_of[index]]
        if key not in seen:
            seen[key] = self.current.stream(key)

    def other_producers(self, b: int) -> list[Any]:
        """The streams besides the current one that produced one of bucket ``b``'s gradients."""
        key = self.current.key()
        return [stream for k, stream in self._producers[b].items() if k != key]

    def wait_for_producers(self, b: int) -> None:
        """Before bucket ``b`` is copied in and launched: the current stream waits for every other producer."""
        others = self.other_producers(b)
        if others:
            current = self.current.stream()
            for stream in others:
                current.wait_stream(stream)
            self.waits += len(others)


def stream_order_for(device: torch.device) -> StreamOrder | None:
    """A ``StreamOrder`` for buckets on a CUDA ``device``; None elsewhere (nothing to order on CPU)."""
    return StreamOrder(device) if device.type == "cuda" else None
