"""Refusing to train on a parameter set that changed after wrapping.

The buckets were built for the parameters (and ``requires_grad`` flags) the module had when it
was wrapped. A parameter or submodule added or replaced later has no gradient hook, and a flag
flipped later leaves a bucket waiting for a gradient that never comes (or reduces one it should
not): both would train silently wrong, so the next forward raises, naming them.
"""

from __future__ import annotations

from torch import nn

from . import watch


class ParameterGuard:
    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._trainable = [p for _, p in module.named_parameters()]
        self._flags = [p.requires_grad for p in self._trainable]
        self._added: list[str] = []  # "submodule.name" of what was registered after wrapping
        self.watch()

    def watch(self) -> None:
        """Listen for registrations under the module (again, after unpickling)."""
        watch.watch(self._module, self._on_module_changed)

    def _on_module_changed(self, module: nn.Module, name: str) -> None:
        prefix = next((n for n, m in self._module.named_modules() if m is module), "?")
        self._added.append(f"{prefix}.{name}" if prefix else name)

    def check(self, rank: int) -> None:
        """Before a grad-enabled forward: raise if the trainable parameters are not those wrapped."""
        if self._added:
            raise RuntimeError(
                f"Parameters or submodules {self._added} were added to (or replaced in) the module after it was "
                f"wrapped in DistributedDataParallel (rank {rank}); their gradients would never be "
                "synchronised. Build the complete model before wrapping it, or wrap it again."
            )
        flags = [p.requires_grad for p in self._trainable]
        if flags == self._flags:
            return
        names = {id(p): n for n, p in self._module.named_parameters()}
        changed = [names.get(id(p), "?") for p, old, new in zip(self._trainable, self._flags, flags) if old != new]
        raise RuntimeError(
            f"requires_grad changed on parameters {changed} after they were wrapped in "
            f"DistributedDataParallel (rank {rank}). The buckets were built for the old "
            "set and would train silently wrong. Freeze or unfreeze layers before wrapping, or wrap "
            "the model again after changing requires_grad."
        )
