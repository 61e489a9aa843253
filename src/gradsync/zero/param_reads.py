"""Which parameters each module's own code reads, learned in the first forward.

[Note: what a module's forward reads]
The parameters' all-gathers after a step are waited for by forward pre-hooks, module by module
([Note: parameters gathered in place] in param_buffers.py). A module's own parameters are not all
it reads: ``nn.MultiheadAttention`` passes ``out_proj.weight`` to a function without ever calling
``out_proj``, a tied decoder reads an embedding's weight, a block may read a child's parameter
before calling the child. Waiting for a module's own parameters alone let such a read see ranges
from before the step whenever the parameter sat in a bucket still in flight (without an error).

So the first forward runs under ``DirectReads``: a dispatch mode that attributes every operator
touching a parameter to the innermost module running (pre- and post-hooks on every module, for
that forward only). A module's hook then waits for the buckets of its own parameters and of
those it read itself. Modules that did not run in that forward (a branch not taken) wait for
every parameter below them, which is safe without knowing what they read. The same forward gives
the parameters' first-use order, which the gathers follow.

It learns the code paths that forward took: a module that reads another module's parameter by
itself only in a branch its first forward did not take is the one case left to
``wait_for_params()`` (docs/zero.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..engine.graph import output_grad_fns, reachable_leaves
from .dispatch_modes import ScopedMode, tensors_in


class DirectReads(ScopedMode):
    """One forward's record: the parameters each module's code read itself, and their first-use order."""

    def __init__(self, modules: list[nn.Module], locate: weakref.WeakMethod[Any]) -> None:
        super().__init__()
        self.modules = modules
        # tensor -> index of the parameter it is (a view of), or None; weakly: its owner holds this record
        self.locate = locate
        self.running: list[nn.Module] = []  # the modules whose forward runs now, innermost last
        self.reads: dict[nn.Module, set[int]] = {}  # module that ran -> parameters its own code read
        self.first_use: dict[int, None] = {}  # parameters in the order the forward first touched them
        self._handles: list[Any] = []

    @property
    def idle(self) -> bool:
        return not self.running

    def start(self, root: nn.Module) -> bool:
        """Called from ``root``'s forward pre-hook; False where the mode cannot be pushed (try the next forward)."""
        if not self.push():
            return False
        self.running, self.reads = [root], {root: set()}
        enter, leave = torch.compiler.disable(self._enter), torch.compiler.disable(self._leave)
        for module in self.modules:
            if module is not root:
                self._handles.append(module.register_forward_pre_hook(enter))
                self._handles.append(module.register_forward_hook(leave, always_call=True))
        return True

    def stop(self) -> bool:
        """Called from ``root``'s forward hook; True when the record is complete (the mode came off the stack)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.running = [], []
        return self.pop()

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.running.append(module)
        self.reads.setdefault(module, set())

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        locate = self.locate() if self.running else None
        if locate is not None:
            reader = self.reads[self.running[-1]]
            for tensor in tensors_in(args, kwargs):
                param = locate(tensor)
                if param is not None:
                    self.first_use.setdefault(param)
                    reader.add(param)
        return func(*args, **kwargs)


class ModuleReads:
    """Which parameters each module's forward pre-hook waits for: its own and those its code read, once a
    forward's record was taken; everything below it before that, or for a module that did not run then."""

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor], locate: weakref.WeakMethod[Any]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        modules = list(module.modules())
        self.params = params  # by engine index
        self.own = {m: {index[id(p)] for p in m.parameters(recurse=False) if id(p) in index} for m in modules}
        self.below = {m: {index[id(p)] for p in m.parameters() if id(p) in index} for m in modules}
        self.hooked = [m for m in modules if self.below[m]]  # the modules whose pre-hook may wait
        self.read: dict[nn.Module, set[int]] | None = None  # the record, once taken
        self.first_use: list[int] = []  # parameters in the order the recorded forward first touched them
        self.learnable = True  # False once a record missed a parameter the forward used (compiled code)
        self._recorder = DirectReads(self.hooked, locate)
        self._recording = False

    def wanted(self, module: nn.Module) -> set[int]:
        if self.read is None or module not in self.read:
            return self.below[module]
        return self.own[module] | self.read[module]

    def forward_starts(self, root: nn.Module) -> None:
        # A forward with autograd recording, so that the record can be checked against the graph.
        if self.read is None and self.learnable and not self._recording and torch.is_grad_enabled():
            self._recording = self._recorder.start(root)

    def forward_ends(self, output: Any) -> bool:
        """Whether this forward's record was taken (then the waits change)."""
        if not self._recording:
            return False
        self._recording = False
        # A forward that raised (no output) leaves a partial record: learn in the next one instead.
        if not self._recorder.stop() or output is None:
            return False
        # Compiled code runs where the record cannot see: if it missed a parameter, never learn.
        used = reachable_leaves(output_grad_fns(output))
        seen = self._recorder.first_use
        if any(id(param) in used and i not in seen for i, param in enumerate(self.params)):
            self.learnable = False
            return False
        self.read, self.first_use = self._recorder.reads, list(seen)
        return True
