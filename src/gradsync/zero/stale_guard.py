"""Between a step and the next forward, nothing reads a parameter whose all-gather is still on the wire.

[Note: the guard over parameters in flight]
After ``step()`` the parameters' all-gathers overlap the next forward ([Note: parameters gathered
in place] in param_buffers.py): the forward's module hooks wait for each bucket just before it is
used. Code that runs between the step and that forward by itself (an EMA of the weights, a norm
for logging, ``copy.deepcopy(model)``, a checkpoint, an evaluation through the inner module) would
read ranges from before the step, without an error. So while gathers are in flight a dispatch mode
watches every operator this thread runs: one that touches the storage of a bucket still being
gathered (reading or writing, through the parameter, ``.data``, a view or a list of them) waits
for that bucket first. ``.data`` and ``detach`` are operators too, so ``numpy()`` and
``torch.save`` of a parameter are covered. Not covered, and needing ``wait_for_params()``: other
threads, and reading memory behind torch's back (``tolist()``, ``data_ptr()``, ``untyped_storage()``).

The mode costs a Python call per operator while it is on the stack, so it leaves when the next
forward starts (the module hooks take over) or when nothing is in flight any more: at the next
gradsync call outside its handler (a forward of the model, a step, ``wait_for_params``, a state
dict, another optimizer's step), since a mode cannot leave from inside its own handler. torch.compile
runs a compiled function eagerly while a mode is on the stack, so one called in that window is
exact but not compiled. The mode is never pushed over a mode that is not gradsync's ([Note: a
mode pushed outside a with block] in dispatch_modes.py): then ``arm`` says so and the step waits
for its gathers itself, as with ``overlap_param_gather=False``.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from .dispatch_modes import ScopedMode, storage_key, tensors_in


class Gathers(Protocol):
    def wait(self, bucket: int) -> None:
        """Until that bucket's all-gather is done and its parameters whole."""

    def settled(self) -> bool:
        """Whether every all-gather in flight has arrived, whole (nothing is left to guard)."""


class StaleGuard(ScopedMode):
    """Waits for a bucket's all-gather before any operator touches its storage, while armed."""

    def __init__(self, gathers: Gathers) -> None:
        super().__init__()
        self.gathers = weakref.ref(gathers)  # weakly: a guard left on the stack keeps no optimizer alive
        # storage address -> bucket, for the buckets still in flight (storage_key's None never among them)
        self.watched: dict[int | None, int] = {}
        self.waits = 0  # buckets waited for because an operator touched them (what the guard prevented)

    @property
    def idle(self) -> bool:
        """Nothing to watch: disarmed, the optimizer is gone, or every gather arrived though none was waited for
        (the last step of a run, then another model: the guard must not stay on the stack for good)."""
        gathers = self.gathers()
        return not self.watched or gathers is None or gathers.settled()

    def arm(self, watched: dict[int | None, int]) -> bool:
        """Watch these buckets' storages; False where the mode cannot be pushed (the caller waits instead)."""
        if not watched or not self.push():
            return False
        self.watched = dict(watched)
        return True

    def forget(self, key: int | None) -> None:
        """That storage's gather was waited for; off the stack when none is left (where it can leave now)."""
        self.watched.pop(key, None)
        if not self.watched:
            self.pop()

    def disarm(self) -> None:
        """Stop watching (the forward's module hooks take over); off the stack where it can leave now."""
        self.watched = {}
        self.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        gathers = self.gathers() if self.watched else None
        if gathers is not None:
            for tensor in tensors_in(args, kwargs):
                bucket = self.watched.get(storage_key(tensor))
                if bucket is not None:
                    self.waits += 1
                    gathers.wait(bucket)
        return func(*args, **kwargs)
