"""torch's plain optimizer ``state_dict`` format, to and from per-parameter full state.

A plain state dict numbers the parameters in param-group order and keys their state by those
numbers; gradsync's state is keyed by engine index (the wrapper's parameter order). ``index``
maps ``id(parameter)`` to its engine index.
"""

from __future__ import annotations

from typing import Any

FullState = dict[int, dict[str, Any]]  # engine index -> {state key: full tensor or scalar}


def to_plain(full: FullState, param_groups: list[dict[str, Any]], index: dict[int, int]) -> dict[str, Any]:
    """``{"state": {number: ...}, "param_groups": [...]}`` as an unsharded torch optimizer gives it."""
    numbering: dict[int, int] = {}
    groups = []
    for group in param_groups:
        indices = [numbering.setdefault(id(p), len(numbering)) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    state = {}
    for group in param_groups:
        for param in group["params"]:
            values = full.get(index[id(param)])
            if values is not None:
                state[numbering[id(param)]] = values
    return {"state": state, "param_groups": groups}


def from_plain(state_dict: dict[str, Any], param_groups: list[dict[str, Any]], index: dict[int, int]) -> FullState:
    """The full state by engine index; the groups' hyper-parameters are updated in place (as torch does)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, param_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        )
    full: FullState = {}
    for saved, mine in zip(groups, param_groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})
        for number, param in zip(saved["params"], mine["params"]):
            if number in state_dict["state"]:
                full[index[id(param)]] = state_dict["state"][number]
    return full
