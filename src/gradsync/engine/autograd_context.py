"""Backwards whose gradients go into a distributed autograd context instead of ``.grad``.

[Note: DDP under distributed autograd]
With the RPC framework, users compute gradients with ``dist_autograd.backward(context_id, [loss])``
and step with ``DistributedOptimizer``, which reads ``dist_autograd.get_gradients(context_id)``:
no ``.grad`` is written, and the averaged gradient must land in the context. What autograd does
there, established by experiment on torch 2.13 (docs/rpc.md has the script and its output):

- ``register_post_accumulate_grad_hook`` hooks do **not** fire: the distributed engine captures the
  gradient of each ``AccumulateGrad`` node instead of running it. The node's own post hooks
  (``node.register_hook``) do, after the gradient was accumulated into the context; tensor hooks
  and node pre-hooks fire too. So a dist backward is followed through post hooks on the
  parameters' ``AccumulateGrad`` nodes (``AccumulatorHooks``), registered only once the RPC
  framework runs: an ordinary backward without RPC pays nothing for them.
- The hooks run on the distributed engine's threads, where no context is current. The context is
  taken at the forward, in the caller's thread (torch's reducer does the same), so a context
  entered only after the forward cannot be known - and is refused by name.
- ``get_gradients`` returns the context's own tensors (dense and sparse): an in-place ``copy_``
  writes the average where ``DistributedOptimizer`` reads it. Nothing public adds an entry, so a
  parameter this rank did not use keeps no gradient in its context (torch's reducer asserts there).
- A callback queued with ``queue_callback`` runs at the end of the *graph task* that queued it.
  On the worker that calls ``dist_autograd.backward`` gradients that come back through an RPC
  (a remote module inside the wrapped one) arrive in that same task, before its callbacks run
  (observed: graph task 0 throughout). A worker that a backward reaches only through RPCs may run
  more than one; so the reducer queues its end-of-backward check in each task that delivers
  gradients, and finishes in the first after which every bucket has been launched
  (``Reducer._on_context_callback``); never in one with buckets still waiting for gradients.
- ``torch._C._will_engine_execute_node(node)`` on an ``AccumulateGrad`` node, asked at the start
  of a backward, says what kind it is (``BackwardKind``): True in an ordinary backward; False
  under distributed autograd (captured, not run) and for ``backward(inputs=...)`` without that
  parameter; it raises while ``torch.autograd.grad`` takes that parameter as an input.

The private names used here (``_current_context``, ``_is_current_rpc_agent_set``,
``_will_engine_execute_node``, ``_current_graph_task_id``, the context's ``_send_functions``) are
torch's autograd and RPC internals, not c10d's or DDP's; each is looked up defensively.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


class BackwardKind(enum.Enum):
    ORDINARY = "ordinary"  # accumulates into .grad: the post-accumulate-grad hooks report
    NOT_ACCUMULATING = "not accumulating"  # dist_autograd.backward, or backward(inputs=...) without us
    AUTOGRAD_GRAD = "autograd.grad"  # torch.autograd.grad with wrapped parameters as inputs


def _find_agent_check() -> Callable[[], bool]:
    try:
        from torch.distributed.rpc import api
    except ImportError:  # a torch built without RPC
        return lambda: False
    return getattr(api, "_is_current_rpc_agent_set", None) or (lambda: False)


_agent_is_set: Callable[[], bool] | None = None  # looked up once: this is asked at every synced forward


def rpc_running() -> bool:
    """Whether this process has initialised the RPC framework (about 0.1 us)."""
    global _agent_is_set
    if _agent_is_set is None:
        _agent_is_set = _find_agent_check()
    return bool(_agent_is_set())


def current_context_id() -> int | None:
    """The distributed autograd context the calling thread is inside, or None."""
    try:
        import torch.distributed.autograd as dist_autograd

        return int(dist_autograd._current_context()._context_id())
    except (ImportError, AttributeError, RuntimeError):  # no context on this thread
        return None


def context_send_functions(context_id: int) -> list[torch.autograd.graph.Node]:
    """The ``SendRpcBackward`` nodes of a context: roots of the local graph pieces whose gradient
    comes back from another worker (what a search for unused parameters must start from too)."""
    try:
        import torch.distributed.autograd as dist_autograd

        context = dist_autograd._retrieve_context(context_id)
        return list(context._send_functions().values())
    except (ImportError, AttributeError, RuntimeError):
        return []


def graph_task_id() -> int:
    """Which graph task of the autograd engine runs the calling hook (-1: none, or unknown)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def accumulator_node(param: torch.Tensor) -> Any:
    """``param``'s ``AccumulateGrad`` node: the one a live graph holds, else a new one."""
    # The ignores below: the view of a parameter that requires grad has a grad_fn.
    if torch.is_grad_enabled():  # at a synced forward it is: torch.enable_grad() alone costs 10 us
        return param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def classify_backward(nodes: Iterable[Any]) -> BackwardKind:
    """What kind of backward is starting, asked of the parameters' ``AccumulateGrad`` nodes.

    The first node settles an ordinary backward in one call; only otherwise are the rest asked
    (``nodes`` may be a generator that fetches them as asked; [Note: DDP under distributed autograd]).
    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return BackwardKind.ORDINARY
    for node in nodes:
        try:
            if will_execute(node):
                return BackwardKind.ORDINARY  # usually settled by the first node
        except RuntimeError:  # "A leaf node was passed ... while running autograd.grad()"
            return BackwardKind.AUTOGRAD_GRAD
    return BackwardKind.NOT_ACCUMULATING


class ContextGradients:
    """The gradients of one dist backward: read from its context, averages written back in place.

    Without a context (a forward outside ``dist_autograd.context()``), the incoming gradients the
    hooks saw are what this rank contributes, so the group's collectives still match; nothing is
    written, and the reducer raises.
    """

    def __init__(self, context_id: int | None) -> None:
        self.context_id = context_id
        self.captured: dict[int, torch.Tensor] = {}  # id(param) -> incoming gradient (no context)
        self.missing_context = False  # the context was released before the averages were written
        self.unplaced: list[int] = []  # parameters used by some rank whose average had no place here

    def _gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        if self.context_id is None:
            return {}
        import torch.distributed.autograd as dist_autograd

        try:
            return dist_autograd.get_gradients(self.context_id)
        except RuntimeError:  # "Could not find autograd context with id ..."
            self.missing_context = True
            return {}

    def read(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Each parameter's gradient in the context (None: none there)."""
        if self.context_id is None:
            return [self.captured.get(id(p)) for p in params]
        grads = self._gradients()
        return [grads.get(p) for p in params]

    def write(self, params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[int]:
        """Copy ``values`` into the context's gradients of ``params``, in place; the positions of
        those the context holds no gradient for."""
        if self.context_id is None:
            return []
        grads = self._gradients()
        missing = []
        for position, (param, value) in enumerate(zip(params, values)):
            grad = grads.get(param)
            if grad is None:
                missing.append(position)
            else:
                grad.copy_(value)
        return missing


def _weak_node_hook(owner_ref: weakref.ref[Any], index: int) -> Callable[[Any, Any], None]:
    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        owner = owner_ref()
        if owner is not None:
            owner._on_context_grad(index, grad_outputs[0] if grad_outputs else None)

    return hook


class AccumulatorHooks:
    """Post hooks on the parameters' ``AccumulateGrad`` nodes: they fire under distributed autograd.

    The nodes must be kept alive by the owner (``DistributedBackwards``): autograd holds a
    parameter's accumulator only weakly, and one made again later would not carry the hooks.
    """

    def __init__(self, owner: Any, nodes: Sequence[Any]) -> None:
        owner_ref = weakref.ref(owner)
        self.nodes = list(nodes)
        self.handles = [node.register_hook(_weak_node_hook(owner_ref, i)) for i, node in enumerate(self.nodes)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class DistributedBackwards:
    """What one reducer knows about distributed autograd, from forward to the end of backward.

    The reducer asks it three things: after a forward, which context the backward may write into
    (``arm``); at the start of a backward, what kind it is (``kind_at_start``, ``kind_for``); and in
    a dist backward, whether the calling hook is the first of its graph task (``first_in_task``).
    """

    def __init__(self, owner: Any, params: Sequence[torch.Tensor]) -> None:
        self._owner = weakref.ref(owner)
        self.params = params
        # The parameters' AccumulateGrad nodes, asked what kind each backward is, and held so that
        # the post hooks on them (once RPC runs) stay where autograd looks. On a GPU only once RPC
        # runs: there a node keeps the stream it was made on, and holding them would change which
        # stream accumulates every gradient ([Note: stream order] in streams.py). A CPU has none.
        self.accumulators: list[Any] | None = None
        if params[0].device.type == "cpu":
            self.accumulators = [accumulator_node(p) for p in params]
        self.hooks: AccumulatorHooks | None = None
        self._probe: Any = None  # without them, the first parameter's node, fetched at the forward
        self.armed_context: int | None = None  # the context the armed forward ran in (None: none)
        self.kind: BackwardKind | None = None  # the running backward's kind, once asked
        self._tasks: set[int] = set()  # graph tasks of the running dist backward seen so far

    def arm(self) -> None:
        """After a synced forward: note its context; hook the accumulators once RPC runs."""
        self.armed_context = None
        if rpc_running():
            if self.hooks is None:
                if self.accumulators is None:
                    self.accumulators = [accumulator_node(p) for p in self.params]
                self.hooks = AccumulatorHooks(self._owner(), self.accumulators)
            self.armed_context = current_context_id()
        elif self.accumulators is None:  # a GPU without RPC: 8 us here, from the graph the forward built
            self._probe = accumulator_node(self.params[0])

    def search_roots(self, roots: list[Any]) -> list[Any]:
        """Where a search for unused parameters starts: under distributed autograd, gradients also
        come back into this worker's graph through the context's sends."""
        if self.armed_context is None:
            return roots
        return roots + context_send_functions(self.armed_context)

    def kind_at_start(self) -> BackwardKind:
        """A backward through the armed forward's outputs starts: what kind is it?"""
        nodes: Iterable[Any] | None = self.accumulators
        if nodes is None:  # a GPU without RPC: the first node settles an ordinary backward; the rest as asked
            probe, self._probe = self._probe, None
            first = [probe] if probe is not None else []
            nodes = itertools.chain(first, (accumulator_node(p) for p in self.params[len(first) :]))
        self.kind = classify_backward(nodes)
        return self.kind

    def kind_for(self, index: int) -> BackwardKind:
        """The running backward's kind, asked of parameter ``index`` if nothing asked before (a
        parameter used outside the forward reports before any output node runs)."""
        if self.kind is None:  # only hooks registered once RPC runs ask this: the nodes are held
            self.kind = classify_backward([self.accumulators[index]])  # type: ignore[index]  # held: see above
        return self.kind

    def first_in_task(self) -> bool:
        """Whether the calling hook is the first of its graph task in this dist backward."""
        task = graph_task_id()
        if task in self._tasks:
            return False
        self._tasks.add(task)
        return True

    def end_backward(self) -> None:
        self.kind = None
        self._tasks.clear()

    def remove_hooks(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
