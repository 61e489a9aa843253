"""A whole training step captured in a CUDA graph, and torch.compile of the wrapped model (world size 1, NCCL).

CUDA graphs (torch's docs/source/notes/cuda.rst, "Usage with DistributedDataParallel"): capture runs
the Python hooks once and a replay repeats only the kernels, so the step must hold no host
synchronisation, no allocation outside the graph's pool and buckets that no longer change (gradsync
rebuilds them once, before the second iteration). torch's DDP must be built inside a side-stream
context because its reducer holds the AccumulateGrad nodes, which keep the stream current at
construction: on the legacy default stream they would put work outside the capture. gradsync's
reducer holds them only once RPC runs (engine/autograd_context.py), but it is built the same way for a
like-for-like step, then warmed up for 11 eager steps on that stream and captured, as the notes prescribe.

torch.compile: the wrapper's own steps are kept out of the graph (``torch.compiler.disable``), the
module's forward is compiled and the gradient hooks run as AccumulateGrad fires. Numbers are compared
with a tolerance: compiled kernels may round differently from eager ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_models import NO_CUDA, batch, model_and_reference

from gradsync import DistributedDataParallel as DDP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)

WARMUP = 11  # "at least 11 DDP-enabled eager iterations" before capture (torch's notes)


@pytest.mark.parametrize("as_view", [False, True])
def test_whole_step_in_a_cuda_graph(nccl_world, as_view: bool) -> None:
    model, reference = model_and_reference("mlp")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # "DDP must be constructed in a side-stream context" (torch's notes)
        ddp = DDP(model, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    static_x, static_y = (t.clone() for t in batch("mlp", 0))

    def eager_reference_step(step: int) -> None:
        x, y = batch("mlp", step)
        reference_optimizer.zero_grad(set_to_none=True)
        F.mse_loss(reference(x), y).backward()
        reference_optimizer.step()

    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            x, y = batch("mlp", step)
            static_x.copy_(x)
            static_y.copy_(y)
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(ddp(static_x), static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    for step in range(WARMUP):
        eager_reference_step(step)

    # Nothing of the warm-up left in flight: NCCL's watchdog then has no earlier work to poll (an event
    # query from another thread during a capture in the default "global" mode invalidates it).
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):  # records, does not run: the reference takes no step for it
        F.mse_loss(ddp(static_x), static_y).backward()
        optimizer.step()
    for step in range(WARMUP, WARMUP + 3):
        x, y = batch("mlp", step)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_reference_step(step)
    torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name} after replays: {m}")


@pytest.mark.parametrize("where", ["compile(ddp)", "ddp(compile(module))"])
def test_torch_compile(nccl_world, where: str) -> None:
    model, reference = model_and_reference("mlp")
    ddp = torch.compile(DDP(model)) if where == "compile(ddp)" else DDP(torch.compile(model))
    engine = (ddp._orig_mod if hasattr(ddp, "_orig_mod") else ddp).engine
    for step in range(3):
        x, y = batch("mlp", step)
        model.zero_grad()
        reference.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        F.mse_loss(reference(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    torch.cuda.synchronize()
    assert engine.iteration == 3, f"{where}: {engine.iteration} synced backwards reduced, expected 3"
