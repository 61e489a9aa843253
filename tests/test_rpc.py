"""DDP under distributed autograd (the RPC framework): the averaged gradient lands in the context.

Each test starts the RPC framework (TensorPipe, its own TCP rendezvous) in fresh workers, trains
inside ``dist_autograd.context()`` with ``dist_autograd.backward`` and compares what the context
holds with torch's DDP doing the same and with a one-process computation of the same average.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as DDP
from rpc_support import context_step, dense, remote_forward, start_rpc, stop_rpc

from harness import _free_port, run_distributed
from models import global_batch, loss_fn, make_model, reference_step, shard

pytestmark = pytest.mark.timeout(240)

# label, model (tests/models.py), constructor arguments, comm hook
OPTIONS = [
    ("default", "mlp", {}, None),
    ("small buckets", "mlp", {"bucket_cap_mb": 0.001}, None),
    ("gradient_as_bucket_view", "mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, None),
    # torch 2.13's reducer fails an internal assert here (it asks the context for the gradient of
    # the parameter no rank used): only the one-process average is the yardstick.
    ("find_unused_parameters", "unused_branch", {"find_unused_parameters": True}, None),
    ("static_graph", "mlp", {"static_graph": True}, None),
    ("comm hook", "mlp", {}, default_hooks.allreduce_hook),
    ("sparse", "sparse_embedding", {}, None),
]
STEPS = 3


def _one_process_average(name: str, model: torch.nn.Module, step: int, world_size: int) -> list:
    """The gradient every rank's context must hold: one process, every rank's shard."""
    x, y = global_batch(name, world_size, step)
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    reference_step(reference, x, y, world_size)
    return [dense(p.grad) for p in reference.parameters()]


def _check_option(label: str, name: str, kwargs: dict, hook, rank: int, world_size: int) -> None:
    model = make_model(name)
    ours, theirs = DDP(copy.deepcopy(model), **kwargs), TorchDDP(copy.deepcopy(model), **kwargs)
    if hook is not None:
        ours.register_comm_hook(None, hook)
        theirs.register_comm_hook(None, hook)
    for step in range(STEPS):
        x, y = global_batch(name, world_size, step)
        batch, target = shard(x, rank, world_size), shard(y, rank, world_size)
        expected = _one_process_average(name, ours.module, step, world_size)
        local = copy.deepcopy(ours.module)
        loss_fn(local(batch), target).backward()
        got = context_step(ours, batch, list(ours.module.parameters()), lambda out, target=target: loss_fn(out, target))
        torch_got = got
        if not kwargs.get("find_unused_parameters"):
            torch_got = context_step(
                theirs, batch, list(theirs.module.parameters()), lambda out, target=target: loss_fn(out, target)
            )
        params = list(ours.module.named_parameters())
        for (pname, param), g, t, e, mine in zip(params, got, torch_got, expected, local.parameters()):
            where = f"{label}, step {step}, rank {rank}, {pname}"
            assert param.grad is None, f"{where}: .grad was written by a dist backward"
            if e is None:  # no rank used it: no gradient in any context, as with torch
                assert g is None and t is None, f"{where}: a gradient for an unused parameter"
                continue
            assert g is not None and t is not None, f"{where}: no gradient in the context"
            assert torch.allclose(dense(g), e, atol=1e-6, rtol=1e-5), f"{where}: not the one-process average"
            assert torch.allclose(dense(g), dense(t), atol=1e-7, rtol=1e-6), f"{where}: differs from torch's DDP"
            if hook is None and not g.is_sparse:  # same buckets, same sums: torch's bits
                assert torch.equal(g, t), f"{where}: not bitwise torch's DDP"
            # negative control: the shards differ, so a skipped average would fail the check above
            assert not torch.allclose(dense(mine.grad), e, atol=1e-6), f"{where}: local equals average"
        with torch.no_grad():  # the same SGD step on both, from the averaged gradient
            for param, other, g in zip(ours.module.parameters(), theirs.module.parameters(), got):
                if g is not None:
                    param.sub_(0.1 * dense(g))
                    other.sub_(0.1 * dense(g))


def _train_options(port: int) -> list[str]:
    torch.set_num_threads(1)
    start_rpc(port)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    checked = []
    try:
        for label, name, kwargs, hook in OPTIONS:
            _check_option(label, name, kwargs, hook, rank, world_size)
            checked.append(label)
    finally:
        stop_rpc()
    return checked


def test_context_holds_the_average_across_options():
    """Every option's context gradients equal the one-process average and torch's DDP's (bitwise
    without a comm hook), and ``.grad`` stays untouched."""
    results = run_distributed(_train_options, 2, _free_port(), isolated=True, timeout_s=200)
    assert results[0] == [label for label, *_ in OPTIONS]


# ---------------------------------------------------------------------------------------------
# The shapes users build with a remote part: ranks 0 and 1 train (the DDP group is that subgroup),
# rank 2 holds the remote modules (a parameter server).

TRAINERS = [0, 1]


class WholeHybrid(torch.nn.Module):
    """(b): fc1, then a module on the remote worker, then fc2: one wrapper around all of it, so a
    dist backward delivers fc2's gradients in one graph task and fc1's in a later one."""

    def __init__(self, remote: rpc.RRef) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)
        self.remote = remote

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(remote_forward(self.remote, torch.tanh(self.fc1(x))))


class DdpThenRemote(torch.nn.Module):
    """(c): a module holding a DDP-wrapped part whose output goes on to a remote module."""

    def __init__(self, ddp_part: torch.nn.Module, remote: rpc.RRef) -> None:
        super().__init__()
        self.local, self.remote = ddp_part, remote

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return remote_forward(self.remote, torch.tanh(self.local(x)))


def _remote_linear(d_in: int, d_out: int) -> torch.nn.Module:
    """Runs on the remote worker's RPC threads, two trainers' at once: its own generator, not the
    global one (seeding that from two threads interleaves their draws)."""
    generator = torch.Generator().manual_seed(7)
    module = torch.nn.Linear(d_in, d_out)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / d_in**0.5)
    return module


def _build(shape: str, wrap, group):
    """(model to call, wrapped module, remote RRef) for one shape; ``wrap`` is gradsync's or torch's DDP."""
    if shape == "remote then ddp":  # (a), and (d): the remote module on the parameter server
        remote = rpc.remote("worker2", _remote_linear, args=(16, 8))
        torch.manual_seed(5)
        wrapped = wrap(torch.nn.Linear(8, 4), process_group=group)
        return (lambda x: wrapped(torch.tanh(remote_forward(remote, x)))), wrapped, remote
    if shape == "whole hybrid":  # (b)
        remote = rpc.remote("worker2", _remote_linear, args=(8, 8))
        wrapped = wrap(WholeHybrid(remote), process_group=group)
        return wrapped, wrapped, remote
    remote = rpc.remote("worker2", _remote_linear, args=(8, 4))  # (c)
    torch.manual_seed(5)
    wrapped = wrap(torch.nn.Linear(16, 8), process_group=group)
    return DdpThenRemote(wrapped, remote), wrapped, remote


def _local_copy(shape: str, wrapped: torch.nn.Module, remote: rpc.RRef):
    """The same computation in one process: the remote module fetched, nothing distributed."""
    remote_copy = remote.to_here()
    if shape == "whole hybrid":  # an RRef cannot be deep-copied: the local layers are
        module = torch.nn.ModuleDict(
            {"fc1": copy.deepcopy(wrapped.module.fc1), "fc2": copy.deepcopy(wrapped.module.fc2)}
        )
        return (lambda x: module.fc2(remote_copy(torch.tanh(module.fc1(x))))), module
    module = copy.deepcopy(wrapped.module)
    if shape == "remote then ddp":
        return (lambda x: module(torch.tanh(remote_copy(x)))), module
    return (lambda x: remote_copy(torch.tanh(module(x)))), module


def _shapes_against_torch(port: int, shapes: list[str]) -> list[str]:
    torch.set_num_threads(1)
    start_rpc(port)
    rank, checked = dist.get_rank(), []
    group = dist.new_group(TRAINERS)
    try:
        if rank in TRAINERS:
            for shape in shapes:
                _check_shape(shape, rank, group)
                checked.append(shape)
            # static_graph reduces its first iteration as a whole at the end of backward: on the
            # worker that calls dist_autograd.backward that end comes after fc1's gradient returned
            _check_shape("whole hybrid", rank, group, static_graph=True)
            checked.append("whole hybrid, static_graph")
    finally:
        stop_rpc()
    return checked


def _check_shape(shape: str, rank: int, group, **options) -> None:
    world = len(TRAINERS)
    ours_call, ours, _ = _build(shape, lambda m, **kw: DDP(m, **kw, **options), group)
    torch_call, theirs, torch_remote = _build(shape, lambda m, **kw: TorchDDP(m, **kw, **options), group)
    params, torch_params = list(ours.module.parameters()), list(theirs.module.parameters())
    for step in range(2):
        x, y = global_batch("mlp", world, step)
        batch, target = shard(x, rank, world), shard(y, rank, world)
        local_call, local_module = _local_copy(shape, theirs, torch_remote)
        losses = [loss_fn(local_call(shard(x, r, world)), shard(y, r, world)) for r in range(world)]
        (sum(losses) / world).backward()
        expected = [p.grad for p in local_module.parameters()]
        got = context_step(ours_call, batch, params, lambda out, target=target: loss_fn(out, target))
        torch_got = context_step(torch_call, batch, torch_params, lambda out, target=target: loss_fn(out, target))
        for (name, param), g, t, e in zip(ours.module.named_parameters(), got, torch_got, expected):
            where = f"{shape}, step {step}, rank {rank}, {name}"
            assert param.grad is None and g is not None, f"{where}: .grad written, or nothing in the context"
            assert torch.allclose(g, e, atol=1e-6, rtol=1e-5), f"{where}: not the one-process average"
            assert torch.equal(g, t), f"{where}: not bitwise torch's DDP"
        with torch.no_grad():
            for param, other, g in zip(params, torch_params, got):
                param.sub_(0.1 * g)
                other.sub_(0.1 * g)


def test_hybrid_models_with_remote_parts_against_torch():
    """(a) a remote module before the wrapped part, (b) one wrapped around local layers with a
    remote module between them, (c) the wrapped part inside a module that calls a remote one
    after it; (d) in each the DDP group is the trainers' subgroup and rank 2 holds the remote
    modules. Context gradients equal torch's DDP's bit for bit and the one-process average."""
    shapes = ["remote then ddp", "whole hybrid", "ddp then remote"]
    results = run_distributed(_shapes_against_torch, 3, _free_port(), shapes, isolated=True, timeout_s=200)
    expected = [*shapes, "whole hybrid, static_graph"]
    assert results[:2] == [expected, expected] and results[2] == []


# ---------------------------------------------------------------------------------------------
# join, no_sync and misuse, two trainers


def _uneven_inputs_and_no_sync(port: int) -> None:
    """join: rank 0 has three batches, rank 1 one (torch's own uneven-inputs comparison); no_sync:
    a dist backward under it leaves this rank's own gradient in the context."""
    torch.set_num_threads(1)
    start_rpc(port)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        model = make_model("mlp")
        ours, theirs = DDP(copy.deepcopy(model)), TorchDDP(copy.deepcopy(model))
        batches = 3 if rank == 0 else 1
        x, y = global_batch("mlp", world, 0, per_rank=4 * 3)
        mine = shard(x, rank, world)
        recorded = {}
        for wrapper in (ours, theirs):  # one join at a time: torch's Join does not nest
            with wrapper.join():
                recorded[wrapper] = [
                    context_step(wrapper, mine[4 * i : 4 * i + 4], list(wrapper.module.parameters()))
                    for i in range(batches)
                ]
        for i, (got, torch_got) in enumerate(zip(recorded[ours], recorded[theirs])):
            for g, t in zip(got, torch_got):
                assert torch.equal(g, t), f"join, batch {i}, rank {rank}: differs from torch's DDP"
        reference = copy.deepcopy(model)  # batch 0: both ranks ran, the average of their first batches
        firsts = [shard(x, r, world)[:4] for r in range(world)]
        (sum(reference(b).square().sum() for b in firsts) / world).backward()
        for g, p in zip(recorded[ours][0], reference.parameters()):
            assert torch.allclose(g, p.grad, atol=1e-6, rtol=1e-5), f"join, rank {rank}: not the average"
        with ours.no_sync():
            got = context_step(ours, mine[:4], list(ours.module.parameters()))
        local = copy.deepcopy(ours.module)
        local(mine[:4]).square().sum().backward()
        for g, p in zip(got, local.parameters()):
            assert torch.equal(g, p.grad), f"no_sync, rank {rank}: the context should hold the local gradient"
        others = [torch.empty_like(got[0]) for _ in range(world)]
        dist.all_gather(others, got[0])
        assert not torch.equal(others[0], others[1]), "negative control: no_sync gradients should differ by rank"
        _check_overlap(rank)
    finally:
        stop_rpc()


def _check_overlap(rank: int) -> None:
    """Buckets launch while the dist backward runs: the head's bucket before the first layer's
    gradient is even computed (a tensor hook, which distributed autograd runs too, tells when)."""
    events = []

    def recording_hook(state, bucket):
        events.append(f"launch {bucket.index()}")
        return default_hooks.allreduce_hook(None, bucket)

    model = make_model("mlp")
    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, recording_hook)
    model.layers[0][0].weight.register_hook(lambda grad: events.append("first layer gradient"))
    context_step(ddp, torch.randn(4, 16), list(model.parameters()))
    computed = events.index("first layer gradient")
    assert computed > 0 and events[0] == "launch 0", f"rank {rank}: no bucket launched during backward: {events}"
    assert events.count("first layer gradient") == 1 and len(events) > computed + 1, events


def test_join_with_uneven_inputs_and_no_sync_under_dist_autograd():
    """join: each batch equals torch's DDP's, and the first (both ranks ran) the one-process average;
    no_sync: the context holds the local gradient; without it buckets launch during backward."""
    run_distributed(_uneven_inputs_and_no_sync, 2, _free_port(), isolated=True, timeout_s=200)


def _misuse(port: int) -> list[str]:
    torch.set_num_threads(1)
    start_rpc(port)
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = []
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    try:
        # torch.autograd.grad with wrapped parameters as inputs: refused, nothing launched
        ddp = DDP(make_model("mlp"))
        loss = ddp(x).square().sum()
        with pytest.raises(RuntimeError, match="doesn't work with torch.autograd.grad"):
            torch.autograd.grad(loss, list(ddp.parameters()))
        seen.append("autograd.grad")
        # ...but with respect to the input only it is allowed (a gradient penalty), and a backward after it syncs
        inputs = x.clone().requires_grad_()
        loss = ddp(inputs).square().sum()
        torch.autograd.grad(loss, [inputs], retain_graph=True)
        loss.backward()
        grads = [p.grad.clone() for p in ddp.parameters()]
        gathered = [torch.empty_like(grads[0]) for _ in range(world)]
        dist.all_gather(gathered, grads[0])
        assert torch.equal(gathered[0], gathered[1]), "the backward after autograd.grad(input) was not averaged"
        seen.append("autograd.grad on inputs")

        # a context entered only after the forward: named on every rank, no hang
        ddp = DDP(make_model("mlp"))
        loss = ddp(x).square().sum()
        with dist_autograd.context() as context_id:
            with pytest.raises(RuntimeError, match="called outside any distributed autograd context"):
                dist_autograd.backward(context_id, [loss])
        seen.append("context after forward")

        # an ordinary backward through a forward that ran in a context
        ddp = DDP(make_model("mlp"))
        with dist_autograd.context():
            loss = ddp(x).square().sum()
            with pytest.raises(RuntimeError, match="its backward was an ordinary one"):
                loss.backward()
        seen.append("ordinary backward in a context")

        # a parameter used on rank 1 only, with find_unused_parameters: rank 0's context has no
        # place for its average, which rank 0 names instead of stepping without it
        ddp = DDP(make_model("unused_branch"), find_unused_parameters=True)
        with dist_autograd.context() as context_id:
            loss = ddp(x, use_sometimes=rank == 1).square().sum()
            if rank == 0:
                with pytest.raises(
                    RuntimeError, match=r"\['sometimes.weight', 'sometimes.bias'\] got no gradient on rank 0"
                ):
                    dist_autograd.backward(context_id, [loss])
            else:
                dist_autograd.backward(context_id, [loss])
        seen.append("used on one rank only")

        # without find_unused_parameters, rank 1 skips a layer: its dist backward cannot finish (a
        # bucket waits for that layer), rank 0's waits for rank 1's bucket; rank 1's next forward
        # finishes it, so rank 0 completes, and raises naming the layer and the released context
        ddp = DDP(make_model("unused_branch"))
        with dist_autograd.context() as context_id:
            loss = ddp(x, use_sometimes=rank == 0).square().sum()
            dist_autograd.backward(context_id, [loss])
        if rank == 1:
            with pytest.raises(
                RuntimeError, match="'sometimes.weight', 'sometimes.bias'.*received no gradient on rank 1"
            ) as info:
                ddp(x)
            assert f"context {context_id} was released before the averaged gradients" in str(info.value)
        seen.append("a gradient that never comes")
    finally:
        stop_rpc()
    return seen


def test_misuse_under_dist_autograd_is_named():
    results = run_distributed(_misuse, 2, _free_port(), isolated=True, timeout_s=200)
    expected = [
        "autograd.grad",
        "autograd.grad on inputs",
        "context after forward",
        "ordinary backward in a context",
        "used on one rank only",
        "a gradient that never comes",
    ]
    assert results == [expected, expected]


def test_example_trains_a_hybrid_model_under_torchrun():
    """examples/rpc_hybrid.py (README "With the RPC framework"): two trainers and a parameter
    server; it checks its replicas against a one-process replay itself and says OK."""
    from test_torchrun import launch_ok

    out = launch_ok(["--standalone", "--nproc-per-node", "3", "examples/rpc_hybrid.py", "--steps", "4"])
    assert "OK: 4 steps; trainers' replicas identical and equal to the one-process replay" in out


def _hooks_under_dist_autograd(port: int) -> dict:
    """The experiment behind [Note: DDP under distributed autograd]: which hooks fire, on which
    thread, and what a context's gradients are (one worker, no DDP)."""
    import threading

    from gradsync.engine import graph
    from gradsync.engine.autograd_context import BackwardKind, classify_backward

    torch.set_num_threads(1)
    start_rpc(port)
    seen: dict = {}
    try:
        layer = torch.nn.Linear(3, 2)
        weight = layer.weight
        node = weight.view_as(weight).grad_fn.next_functions[0][0]
        log: list = []
        weight.register_post_accumulate_grad_hook(lambda p: log.append("post-accumulate-grad hook"))
        weight.register_hook(lambda g: log.append("tensor hook"))
        node.register_hook(lambda gi, go: log.append(("node post hook", threading.current_thread() is main)))
        main = threading.current_thread()
        x = torch.ones(4, 3, requires_grad=True)

        def run(name, backward):
            log.clear()
            out = layer(x)
            kinds = []
            out.grad_fn.register_prehook(lambda go: kinds.append(classify_backward([node])))
            backward(out.sum())
            seen[name] = (list(log), kinds[0])

        run("ordinary", lambda loss: loss.backward())
        run("autograd.grad(params)", lambda loss: torch.autograd.grad(loss, [weight]))
        run("autograd.grad(input)", lambda loss: torch.autograd.grad(loss, [x]))
        with dist_autograd.context() as context_id:
            run("dist", lambda loss: dist_autograd.backward(context_id, [loss]))
            grads = dist_autograd.get_gradients(context_id)
            grads[weight].mul_(0.5)  # in place: does the context see it?
            seen["context tensors are the context's own"] = torch.equal(
                dist_autograd.get_gradients(context_id)[weight], torch.full((2, 3), 2.0)
            )
        seen["kinds"] = [kind.value for kind in BackwardKind]
        # a forward that returns an RRef it owns is searched through it, as torch's DDP does
        out = layer(x)
        seen["rref output searched"] = graph.output_grad_fns(rpc.RRef(out)) == [out.grad_fn]
    finally:
        stop_rpc()
    return seen


def test_what_autograd_does_under_dist_autograd():
    """The facts the design rests on (docs/rpc.md), checked so that a torch that changes them fails
    here rather than averaging nothing silently."""
    (seen,) = run_distributed(_hooks_under_dist_autograd, 1, _free_port(), isolated=True, timeout_s=120)
    ordinary, kind = seen["ordinary"]
    assert (
        ordinary == ["tensor hook", "post-accumulate-grad hook", ("node post hook", True)] and kind.value == "ordinary"
    )
    dist_log, kind = seen["dist"]
    # no post-accumulate-grad hook; the node's post hook fires, on another thread; the kind says so
    assert dist_log == ["tensor hook", ("node post hook", False)] and kind.value == "not accumulating"
    assert seen["autograd.grad(params)"][1].value == "autograd.grad"
    assert seen["autograd.grad(input)"] == ([], seen["dist"][1])  # nothing fires; not ours to reduce
    assert seen["context tensors are the context's own"]
    assert seen["rref output searched"]
