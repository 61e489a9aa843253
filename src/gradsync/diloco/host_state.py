"""DiLoCo's outer state on a GPU run: ``theta_global`` and the outer optimizer's state in pinned host memory,
one fragment at a time through a staging buffer on the GPU.

[Note: the outer state off the GPU]
``theta_global`` in fp32 and the outer optimizer's momentum are 8 bytes per parameter that plain
training does not hold: 56 GB for a 7 B-parameter model. With CUDA parameters and
``outer_state="host"`` (the default) both live in pinned host memory (the outer optimizer is built
over host tensors, so its state is made there), and the GPU holds one fragment's fp32 values at a
time, in ``Staging.gpu``. One outer step of fragment ``p``:

1. start, on the training thread: the fragment's parameters are copied (as fp32) into the staging
   buffer on the *current* stream, after the inner step that wrote them; the side stream waits for
   that (an event), and copies the staging buffer into the pinned ``down`` buffer, non_blocking. The
   training thread records an event and goes on: no host synchronisation.
2. the exchange: whoever averages (DiLoCo's exchange thread with ``delay > 0``, the training loop
   with ``delay = 0``, where the outer step blocks anyway) first synchronises that event, then takes
   ``delta = theta_global - down`` on the host. The exchange between replicas or islands is gloo on
   host tensors (DiLoCo makes gloo groups of its own for it on a GPU run).
3. landing, on the training thread: the outer optimizer steps ``theta_global`` on the host (one
   flat tensor per fragment: vectorised). The side stream waits for the current stream (its last
   reads of the staging buffer), copies ``theta_global`` into the staging buffer, non_blocking, and
   the current stream waits for that copy (an event): the merge (write, mix or keep-inner-steps) then
   runs on the current stream, parameter by parameter, before the next inner step's kernels.

The values are the device mode's bit for bit: a subtraction, a conversion to fp32 and an
elementwise ``lerp`` give the same bits wherever they run, and the merge uses the device mode's
formulas. What differs is where the outer optimizer's arithmetic runs (the host's CPU against the
GPU): tests/gpu/test_diloco_gpu.py compares the two modes bitwise on the GPU.

GPU memory above plain training: the staging buffer (the largest fragment in fp32), plus, for
``merge="keep_inner_steps"`` or a parameter not in fp32, one parameter's fp32 temporaries while it is
merged. On a CPU run nothing here exists (``kit_for`` returns None): the state already is on the host.

Every stream, event and copy goes through a ``Kit`` so that tests/test_diloco_host_state.py can run
this logic on CPU with fake streams that check each read against the last write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

OUTER_STATES = ("host", "device")


def check_outer_state(outer_state: str) -> None:
    if outer_state not in OUTER_STATES:
        raise ValueError(
            f"outer_state must be one of {OUTER_STATES} (where theta_global and the outer optimizer's state live "
            f"when the parameters are on a GPU: pinned host memory, or the GPU; docs/diloco.md, On GPUs), got "
            f"{outer_state!r}."
        )


class Kit(Protocol):
    """The CUDA calls staging makes: streams, events, copies. ``CudaKit`` on a GPU; fakes in tests."""

    pin: bool  # whether host buffers are pinned

    def current(self) -> Any: ...  # the current stream

    @property
    def side(self) -> Any: ...  # the stream the copies between host and GPU run on

    def using(self, stream: Any) -> Any: ...  # a context manager making ``stream`` current

    def record(self, stream: Any) -> Any: ...  # an event recorded on ``stream`` now

    def op(self, run: Callable[[], object], reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
        """Run ``run`` (which enqueues work on the current stream) reading ``reads`` and writing ``writes``."""

    def host_read(self, tensor: torch.Tensor) -> None: ...  # the host is about to read ``tensor``


class CudaKit:
    """The real thing: one side stream per DiLoCo, events from the stream, copies as they are."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @property
    def side(self) -> torch.cuda.Stream:
        return self._side

    def using(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def op(self, run: Callable[[], object], reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
        run()

    def host_read(self, tensor: torch.Tensor) -> None:
        pass


def kit_for(device: torch.device) -> Kit | None:
    """The kit for parameters on ``device``: a ``CudaKit`` on a GPU, None elsewhere (no staging needed)."""
    return CudaKit(device) if device.type == "cuda" else None


class ToHost:
    """A flat fp32 copy on its way to the host: ``wait()`` synchronises its event and returns it (once)."""

    def __init__(self, kit: Kit, done: Any, host: torch.Tensor, keep: torch.Tensor | None) -> None:
        self._kit = kit
        self._done = done
        self._host = host
        self._keep = keep  # a GPU source that must outlive the copy (the device mode's delta)
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._done.synchronize()
            self._kit.host_read(self._host)
            self._value, self._keep = self._host, None
        return self._value


class StagedDelta:
    """An outer gradient that exists once its copy reached the host: ``wait()`` returns it, flat, fp32.

    The exchange calls ``wait()`` on its own thread ([Note: the outer state off the GPU], step 2);
    ``theta`` given: ``delta = theta - local`` is taken there (host mode), else the copy is the delta.
    """

    def __init__(self, copy: ToHost, theta: torch.Tensor | None) -> None:
        self._copy = copy
        self._theta = theta
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            local = self._copy.wait()
            self._value = local if self._theta is None else self._theta.detach() - local
        return self._value


def ready(delta: torch.Tensor | StagedDelta) -> torch.Tensor:
    """``delta`` itself, or a staged one once it is on the host."""
    return delta if isinstance(delta, torch.Tensor) else delta.wait()


class Staging:
    """A fragment's way between the GPU and the host: ``gpu`` (on the device), ``down`` and ``up`` (pinned, on
    the host), each as long as the largest fragment, and the streams' order around them."""

    def __init__(self, kit: Kit, device: torch.device, numel: int, dtype: torch.dtype) -> None:
        self.kit = kit
        self.gpu = torch.empty(numel, dtype=dtype, device=device)
        self.down = torch.empty(numel, dtype=dtype, pin_memory=kit.pin)
        self.up = torch.empty(numel, dtype=dtype, pin_memory=kit.pin)
        self._side_done: Any = None  # the side stream's last use of ``gpu`` (and of ``up`` or theta, read from)
        self._up_read: Any = None  # the current stream's last reads of ``up`` (keep_inner_steps)

    # -- to the host ---------------------------------------------------------------------------------
    def params_to_host(self, params: Sequence[nn.Parameter], sizes: Sequence[int]) -> ToHost:
        """The parameters, in ``gpu``'s dtype, into ``down``: gathered on the current stream, copied on the side."""
        kit, current = self.kit, self.kit.current()
        if self._side_done is not None:  # the side stream's last use of ``gpu`` is over before we write it
            current.wait_event(self._side_done)
        gpu = self.gpu[: sum(sizes)]
        for view, param in zip(gpu.split(list(sizes)), params):
            kit.op(_copy(view, param.detach().reshape(-1)), reads=[param], writes=[view])
        return self._down(gpu, keep=None)

    def flat_to_host(self, flat: torch.Tensor) -> ToHost:
        """``flat`` (on the device, made on the current stream) into ``down`` on the side stream."""
        return self._down(flat, keep=flat)

    def _down(self, source: torch.Tensor, keep: torch.Tensor | None) -> ToHost:
        kit = self.kit
        kit.side.wait_event(kit.record(kit.current()))  # the side stream copies what the current stream wrote
        host = self.down[: source.numel()]
        with kit.using(kit.side):
            kit.op(_copy(host, source, non_blocking=True), reads=[source], writes=[host])
            done = kit.record(kit.side)
        self._side_done = done
        return ToHost(kit, done, host, keep)

    # -- back to the GPU -------------------------------------------------------------------------------
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (pinned, flat) into ``gpu`` on the side stream; the current stream waits for the copy (an
        event, no host synchronisation). Returns the GPU view, for the current stream to use."""
        kit, current = self.kit, self.kit.current()
        kit.side.wait_event(kit.record(current))  # the current stream's last reads of ``gpu`` come first
        gpu = self.gpu[: host.numel()]
        with kit.using(kit.side):
            kit.op(_copy(gpu, host, non_blocking=True), reads=[host], writes=[gpu])
            landed = kit.record(kit.side)
        current.wait_event(landed)
        self._side_done = landed
        return gpu

    def host_may_write(self) -> None:
        """Before the host writes ``up`` or a ``theta_global`` the GPU read from: those reads have run. They
        always have by then (a start's ``ToHost.wait`` came after them); ``query`` makes sure without a
        synchronisation, which happens only if that reasoning were ever wrong."""
        for event in (self._side_done, self._up_read):
            if event is not None and not event.query():
                event.synchronize()

    def average_to_device(self, average: torch.Tensor) -> torch.Tensor:
        """The device mode's average (a host tensor from the exchange) on the GPU, through ``up``."""
        self.host_may_write()
        up = self.up[: average.numel()]
        up.copy_(average)
        return self.to_device(up)

    # -- the merges, on the current stream -------------------------------------------------------------
    def write(self, params: Sequence[nn.Parameter], theta: torch.Tensor, sizes: Sequence[int]) -> None:
        """``params <- theta_global`` (Fragment.write)."""
        for param, view in zip(params, theta.split(list(sizes))):
            self.kit.op(_copy(param.detach(), view.view_as(param)), reads=[view], writes=[param])

    def mix(self, params: Sequence[nn.Parameter], theta: torch.Tensor, sizes: Sequence[int], alpha: float) -> None:
        """``params <- lerp(theta_global, params, alpha)`` (Fragment.mix's formula), in ``theta``'s GPU copy."""
        for param, view in zip(params, theta.split(list(sizes))):
            self.kit.op(_lerp(view, param, alpha), reads=[view, param], writes=[view])
        self.write(params, theta, sizes)

    def keep_inner_steps(
        self, params: Sequence[nn.Parameter], theta: torch.Tensor, sizes: Sequence[int], at_start: torch.Tensor
    ) -> None:
        """``params <- theta_global + (params - at_start)`` (Fragment.keep_inner_steps's formula); ``at_start``
        is on the host and goes to the GPU one parameter at a time (one parameter's temporaries)."""
        self.host_may_write()
        up = self.up[: at_start.numel()]
        up.copy_(at_start)
        for param, view, start in zip(params, theta.split(list(sizes)), up.split(list(sizes))):
            self.kit.op(_keep(view, param, start), reads=[view, param, start], writes=[view])
        self._up_read = self.kit.record(self.kit.current())
        self.write(params, theta, sizes)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Callable[[], object]:
    return lambda: dst.copy_(src, non_blocking=non_blocking)


def _lerp(view: torch.Tensor, param: torch.Tensor, alpha: float) -> Callable[[], object]:
    return lambda: torch.lerp(view, param.detach().reshape(-1).to(view.dtype), alpha, out=view)


def _keep(view: torch.Tensor, param: torch.Tensor, start: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        at_start = start.to(view.device, non_blocking=True)  # pinned: no host synchronisation
        view.add_(param.detach().reshape(-1).to(view.dtype) - at_start)

    return run
