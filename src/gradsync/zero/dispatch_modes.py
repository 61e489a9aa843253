"""A torch dispatch mode that gradsync pushes and pops itself, and where an operator's tensors live.

[Note: a mode pushed outside a with block]
The guard over parameters still being gathered (stale_guard.py) is pushed when a step returns
and popped at the next forward: no ``with`` block spans that. torch's dispatch-mode stack is one
per thread, and a mode's ``__exit__`` pops whatever is on top. So these modes are pushed only on
a thread whose stack holds none but ours (under a user's mode, that mode's ``__exit__`` would pop
ours in its place and leave its own behind; two sharded optimizers trained in turn, a GAN's, each
push their own), and popped only while on top of the thread that pushed them. A
mode's handler cannot pop it (torch takes the mode off the stack while its handler runs and puts
it back after): a mode whose work ended there stays, *idle*, its handler passing operators
through, until gradsync code runs outside any handler (the next forward, step, wait or push) and
sweeps every idle mode of ours off the top of the stack. A user's mode pushed above ours is popped
by its own ``__exit__``, as it should be; ours then leaves at the next sweep.

Nor is the stack changed while a torch.compile'd call runs (``torch.compile(ddp)``: the hooks of
the modules inside run eagerly, in the middle of it): the compiled code was set up with the modes
there were when it started, and its backward fails torch's internal assert when one of them is
gone. Modes are pushed and popped outside such a call instead (a step, an eager forward).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
)


class ScopedMode(TorchDispatchMode):
    """A dispatch mode pushed by ``push`` and swept off by ``pop`` ([Note: a mode pushed outside a with block])."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is not annotated
        self.thread: int | None = None  # the thread whose stack holds this mode, while it does

    @property
    def idle(self) -> bool:
        """Whether its work is over, so that it may leave the stack."""
        return True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile goes on compiling while this mode is on the stack: a mode that it does not ignore
        makes it skip every frame that starts meanwhile, for good (the code is marked, not the call)."""
        return True

    def push(self) -> bool:  # type: ignore[override]  # torch's classmethod push() makes a new mode
        """Onto this thread's mode stack; False where it cannot go (a mode not ours is there, another thread,
        inside a compiled call)."""
        here = threading.get_ident()
        if self.thread is not None:
            return self.thread == here
        if compiled_call_running():
            return False
        sweep()
        if any(not isinstance(mode, ScopedMode) for mode in _get_current_dispatch_mode_stack()):
            return False
        self.__enter__()  # type: ignore[no-untyped-call]
        self.thread = here
        return True

    def pop(self) -> bool:
        """Sweep the idle modes off this thread's stack; whether this one is off it now."""
        sweep()
        return self.thread is None


def sweep() -> None:
    """Pop the idle modes of ours from the top of this thread's stack (not from inside a handler of ours:
    there the top is the mode below it)."""
    here = threading.get_ident()
    while True:
        top = _get_current_dispatch_mode()
        # The stack walk last: this runs after every forward, mostly with nothing of ours on the stack.
        if not isinstance(top, ScopedMode) or top.thread != here or not top.idle or compiled_call_running():
            return
        top.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        top.thread = None


_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


def compiled_call_running() -> bool:
    """Whether this thread runs inside a call of a torch.compile'd function or module (the eager hooks
    it calls at graph breaks included). The wrapper's frame is ``compile_wrapper`` (torch 2.13), or an
    ``_fn`` closing over the compile context (older releases; ``DisableContext``'s own ``_fn`` is not one)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_EVAL_FRAME):
            if code.co_name == "compile_wrapper":
                return True
            if code.co_name == "_fn" and type(frame.f_locals.get("self")).__name__ not in (
                "DisableContext",
                "NoneType",
            ):
                return True
        frame = frame.f_back
    return False


def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an operator was called with: arguments, keyword arguments, lists of them (``_foreach_*``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (shared by every view of it); None for tensors without one."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less layouts
        return None
