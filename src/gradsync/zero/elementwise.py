"""Which optimizers can step a shard: those whose update of an element reads only that element's state.

A sharded optimizer steps each rank's range of every bucket as pieces of parameters ([Note: state
per piece] in state_exchange.py). That is the same update as stepping whole tensors only when the
optimizer is elementwise: the new value of an element depends on that element's gradient and
state, the step count and the hyperparameters, never on other elements (no norms, no factored
moments, no line search). torch's built-in optimizers below are; checked bitwise against whole
tensors split at arbitrary points (tests/test_zero.py).
"""

from __future__ import annotations

import torch

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def check_elementwise(optimizer_class: type, declared: bool | None) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"ShardedOptimizer needs a torch.optim.Optimizer class, got {optimizer_class!r}.")
    if declared is None:
        declared = issubclass(optimizer_class, ELEMENTWISE) and optimizer_class.step is _base_step(optimizer_class)
    if not declared:
        raise ValueError(
            f"{optimizer_class.__name__} is not known to update each element from that element alone, so it "
            "cannot step a shard of a parameter (LBFGS, Adafactor, LAMB-style per-tensor norms cannot). Use an "
            "elementwise optimizer (SGD, Adam, AdamW, RMSprop, ...), plain DDP for this one, or pass "
            "elementwise=True if its update really is elementwise."
        )


def steps_in_parts(optimizer_class: type) -> bool:
    """Whether stepping some of its parameters, then the rest, is exactly one step over all of them.

    torch's built-in elementwise optimizers (their own ``step``) keep all state per parameter, so
    each call updates just the parameters listed. A class vouched for with ``elementwise=True`` may
    count its calls (a global step, a schedule inside ``step``): it is stepped in one call.
    """
    return issubclass(optimizer_class, ELEMENTWISE) and optimizer_class.step is _base_step(optimizer_class)


def _base_step(optimizer_class: type) -> object:
    """The ``step`` of the built-in class it derives from: a subclass that overrides ``step`` is not vouched for."""
    base = next(cls for cls in optimizer_class.__mro__ if cls in ELEMENTWISE)
    return base.step
