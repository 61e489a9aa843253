"""Stepping each bucket's shard in backward, as its reduce-scatter drains (``step_in_backward=True``).

[Note: the step inside backward]
With one link per rank, DDP hides its whole all-reduce behind backward; a ZeRO-2 step hides only
the reduce-scatter there, and the all-gather comes after the step, where only the next forward
(``overlap_param_gather``) or nothing hides it. ``step_in_backward=True`` steps a bucket's shard as
soon as its reduce-scatter drained and starts its all-gather right away, so the gathers of the
first buckets travel while backward still computes the later ones (the idea of torch's
``_register_fused_optim``, on shards). The update is the optimizer's own, over the bucket's pieces
only, so each element gets exactly the update ``step()`` would give it.

A bucket's parameters are no longer read by the rest of backward once every gradient of theirs
arrived (that is what makes the bucket ready), so writing them then is safe. What it costs in
freedom, each refused by name rather than silently different:

- ``clip_grad_norm_`` needs the norm over every shard before any is stepped: not possible;
- hyper-parameters must be set before the backward that uses them (LR schedulers step after
  ``step()``, as usual); changed between backward and ``step()``, ``step()`` raises;
- ``step()`` must follow every synced backward: the next forward raises otherwise (a step that
  was skipped, for a NaN loss, say, already happened);
- under ``join`` the step runs in ``step()`` as without the option (a joined rank shadows it),
  and with ``find_unused_parameters`` or ``static_graph`` at the end of backward, once the ranks
  agreed which parameters were used (DDP leaves the others' ``.grad`` None: they are not stepped).
"""

from __future__ import annotations

from typing import Any

import torch


class BackwardStep:
    """What the steps taken in backward owe ``step()``: the hyper-parameters they used, and a call."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.used: list[dict[str, Any]] | None = None  # per param group, as the first bucket of the pass saw them
        self.owed = False  # a backward stepped shards and step() was not called since

    def hyperparameters(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Those of ``groups`` to step with now; None when this backward already took them."""
        if self.used is not None:
            return None
        self.used = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        return self.used

    def settle(self, groups: list[dict[str, Any]]) -> None:
        """``step()`` was called: check that the steps in backward used the hyper-parameters set now."""
        used, self.used, self.owed = self.used, None, False
        for g, (before, group) in enumerate(zip(used or [], groups)):
            for key, value in before.items():
                if not _same(value, group.get(key)):
                    raise RuntimeError(
                        f"ShardedOptimizer(step_in_backward=True): param group {g}'s {key!r} changed from {value!r} "
                        f"to {group.get(key)!r} between backward and step() (rank {self.rank}), but the shards were "
                        "already stepped in backward with the old value. Set hyper-parameters before the forward "
                        "(LR schedulers after step(), as usual), or build it with step_in_backward=False."
                    )

    def check_not_owed(self) -> None:
        if self.owed:
            raise RuntimeError(
                f"ShardedOptimizer(step_in_backward=True) stepped this rank's shards in the last backward (rank "
                f"{self.rank}), but optimizer.step() was not called before this forward. A step skipped after "
                "backward (a NaN loss, say) has already happened with this option; call optimizer.step() after "
                "each synced backward, or build it with step_in_backward=False to decide after backward."
            )

    def clip_error(self) -> RuntimeError:
        return RuntimeError(
            f"ShardedOptimizer(step_in_backward=True) cannot clip (rank {self.rank}): each bucket's shard is "
            "stepped as its gradients arrive in backward, before a norm over all of them exists. Build it with "
            "step_in_backward=False to use clip_grad_norm_."
        )


def step_pieces(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], groups_of: list[int | None]) -> None:
    """``optimizer.step()`` over ``tensors`` only (some of its parameters; ``groups_of``: each one's group).

    torch's optimizers step what ``group["params"]`` lists, with state keyed by tensor, so a
    subset stepped alone is updated exactly as in a step over all of them. Tensors without a
    gradient or a group (a piece of a parameter no group holds) are left out, as ``step`` would.
    """
    groups = optimizer.param_groups
    full = [group["params"] for group in groups]
    subsets: list[list[torch.Tensor]] = [[] for _ in groups]
    for tensor, g in zip(tensors, groups_of):
        if tensor.grad is not None and g is not None:
            subsets[g].append(tensor)
    try:
        for group, subset in zip(groups, subsets):
            group["params"] = subset
        optimizer.step()
    finally:
        for group, params in zip(groups, full):
            group["params"] = params


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    return a is b or a == b
