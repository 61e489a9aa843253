"""Where DiLoCo's outer state lives on a GPU run, and how an outer step moves one fragment
([Note: the outer state off the GPU] in host_state.py).

``DiLoCo`` holds one of these when its parameters are on a GPU, None on CPU (where nothing moves and
today's code path runs unchanged):

* ``OnHost`` (``outer_state="host"``, the default): ``theta_global`` pinned on the host, the outer
  optimizer's state made there; the fragment's parameters go down through the staging buffer, the
  new values come back up through it.
* ``OnDevice`` (``outer_state="device"``): ``theta_global`` and the outer optimizer on the GPU, as on
  CPU; only the outer gradient goes down (the exchange runs over gloo on host tensors) and the
  average comes back up, through the same staging buffer.
"""

from __future__ import annotations

from typing import Union

import torch

from . import host_state
from .host_state import Kit, StagedDelta, Staging
from .outer_params import Fragment


class OnHost:
    """``theta_global`` and the outer optimizer's state in pinned host memory."""

    on_host = True

    def __init__(self, kit: Kit, device: torch.device) -> None:
        self.kit = kit
        self.device = device
        self.staging: Staging | None = None  # made once the fragments are known (``prepare``)

    def prepare(self, fragments: list[Fragment]) -> None:
        self.staging = _staging(self.kit, self.device, fragments)

    def outer_gradient(self, fragment: Fragment) -> StagedDelta:
        """Step 1: the local fragment on its way to the host; ``theta - local`` is taken there, when waited for."""
        assert self.staging is not None, "prepare() before the first outer step"
        return StagedDelta(self.staging.params_to_host(fragment.params, fragment.sizes), fragment.theta)

    def gradient(self, fragment: Fragment, average: torch.Tensor) -> torch.Tensor:
        """The outer optimizer's ``.grad`` for ``fragment`` (on the host, where ``theta`` is)."""
        assert self.staging is not None, "prepare() before the first outer step"
        self.staging.host_may_write()  # the optimizer writes theta, which an earlier landing copied up from
        return average.to(fragment.theta.dtype)

    def land(self, fragment: Fragment, delay: int, merge: str, alpha: float, at_start: torch.Tensor | None) -> None:
        """Step 3: the new ``theta_global`` up to the GPU, then merged into the parameters on the current stream.
        ``at_start``: the local fragment when its exchange started (``merge="keep_inner_steps"``), on the host."""
        assert self.staging is not None, "prepare() before the first outer step"
        theta = self.staging.to_device(fragment.theta.detach())
        if delay == 0:
            self.staging.write(fragment.params, theta, fragment.sizes)
        elif merge == "keep_inner_steps":
            assert at_start is not None, "merge='keep_inner_steps' lost the outer gradient it sent"
            self.staging.keep_inner_steps(fragment.params, theta, fragment.sizes, at_start)
        else:
            self.staging.mix(fragment.params, theta, fragment.sizes, alpha)


class OnDevice:
    """``theta_global`` and the outer optimizer on the GPU; the exchange on the host."""

    on_host = False

    def __init__(self, kit: Kit, device: torch.device) -> None:
        self.kit = kit
        self.device = device
        self.staging: Staging | None = None

    def prepare(self, fragments: list[Fragment]) -> None:
        self.staging = _staging(self.kit, self.device, fragments)

    def outer_gradient(self, fragment: Fragment) -> StagedDelta:
        assert self.staging is not None, "prepare() before the first outer step"
        return StagedDelta(self.staging.flat_to_host(fragment.outer_gradient()), None)

    def gradient(self, fragment: Fragment, average: torch.Tensor) -> torch.Tensor:
        assert self.staging is not None, "prepare() before the first outer step"
        return self.staging.average_to_device(average.to(fragment.theta.dtype))


Placement = Union[OnHost, OnDevice]


def placement_for(device: torch.device, outer_state: str) -> Placement | None:
    """``outer_state``'s placement for parameters on ``device``; None where there is nothing to move (CPU)."""
    host_state.check_outer_state(outer_state)
    kit = host_state.kit_for(device)  # looked up on the module: tests hand in a fake kit for a CPU "device"
    if kit is None:
        return None
    return OnHost(kit, device) if outer_state == "host" else OnDevice(kit, device)


def _staging(kit: Kit, device: torch.device, fragments: list[Fragment]) -> Staging:
    dtype = torch.float32
    for fragment in fragments:
        dtype = torch.promote_types(dtype, fragment.theta.dtype)
    return Staging(kit, device, max(f.numel for f in fragments), dtype)
