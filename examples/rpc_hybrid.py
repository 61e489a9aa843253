"""gradsync's DDP with the RPC framework: the seed's example, made to run (README "With the RPC framework").

Run:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 3 examples/rpc_hybrid.py

Ranks 0 and 1 are trainers; rank 2 is a parameter server that holds the model's first layer
(one copy per trainer, as in torch's own DDP-under-RPC tests). Each trainer's forward sends its
batch to its remote layer (``rpc.rpc_sync``) and runs the rest of the model locally, wrapped in
gradsync's ``DistributedDataParallel`` over the trainers' subgroup. Gradients come from
``dist_autograd.backward(context_id, [loss])``: the remote layer's land in the parameter
server's part of the context, the local layers' in the trainer's, and gradsync averages the
local ones across the trainers *inside the context*, where ``DistributedOptimizer`` reads them.
No ``.grad`` is written.

At the end the script checks what it promises: both trainers' local layers are bitwise
identical, and they equal rank 0's replay of the same steps in one process (each step the local
layers take the gradient of the mean loss over both trainers' batches, and each trainer's remote
layer the gradient of its own trainer's loss), and so do the remote layers.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef

from gradsync import DistributedDataParallel as DDP

TRAINERS = [0, 1]
SERVER = "worker2"
LR = 0.05


def _call(method, rref: RRef, *args):
    return method(rref.local_value(), *args)


def remote_forward(rref: RRef, x: torch.Tensor) -> torch.Tensor:
    """The remote layer's forward, run on its owner and recorded by distributed autograd."""
    return rpc.rpc_sync(rref.owner(), _call, args=(nn.Module.__call__, rref, x))


def remote_parameters(rref: RRef) -> list[RRef]:
    return [RRef(p) for p in rref.local_value().parameters()]


def make_remote_layer() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(20, 32)


def make_local_layers() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(step: int, trainer: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + trainer)
    x = torch.randn(size, 20, generator=generator)
    return x, x[:, :5].sum(dim=1, keepdim=True).sin()


def train(steps: int) -> None:
    rank = dist.get_rank()
    trainers = dist.new_group(TRAINERS)  # collective over every rank: the server calls it too
    if rank not in TRAINERS:
        return  # the parameter server only answers RPCs, until rpc.shutdown()
    remote_layer = rpc.remote(SERVER, make_remote_layer)
    local = DDP(make_local_layers(), process_group=trainers)
    start = copy.deepcopy(local.module)
    params = remote_parameters_of(remote_layer) + [RRef(p) for p in local.parameters()]
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LR)
    for step in range(steps):
        x, y = batch(step, rank)
        with dist_autograd.context() as context_id:
            loss = nn.functional.mse_loss(local(remote_forward(remote_layer, x)), y)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    _check(local.module, start, remote_layer, steps, trainers)


def remote_parameters_of(rref: RRef) -> list[RRef]:
    return rpc.rpc_sync(rref.owner(), remote_parameters, args=(rref,))


def _check(trained: nn.Module, start: nn.Module, remote_layer: RRef, steps: int, group: dist.ProcessGroup) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in trained.parameters()])
    replicas = [torch.empty_like(flat) for _ in TRAINERS]
    dist.all_gather(replicas, flat, group=group)
    assert all(torch.equal(replicas[0], r) for r in replicas), "the trainers' replicas differ"
    # Replay in one process: the local layers step on the averaged gradient, each trainer's remote
    # layer on its own trainer's gradient.
    rank = dist.get_rank()
    remotes, local = [make_remote_layer() for _ in TRAINERS], copy.deepcopy(start)
    for step in range(steps):
        losses = [
            nn.functional.mse_loss(local(r(x)), y) for r, (x, y) in zip(remotes, (batch(step, t) for t in TRAINERS))
        ]
        everything = list(local.parameters()) + [p for r in remotes for p in r.parameters()]
        # d(mean loss)/d(remote_t) is 1/2 of d(loss_t)/d(remote_t): the remote layers step on twice that
        grads = torch.autograd.grad(sum(losses) / len(TRAINERS), everything)
        with torch.no_grad():
            n_local = len(list(local.parameters()))
            for i, (p, g) in enumerate(zip(everything, grads)):
                p.sub_(LR * (g if i < n_local else g * len(TRAINERS)))
    for (name, p), q in zip(trained.named_parameters(), local.parameters()):
        assert torch.allclose(p, q, atol=1e-5), f"rank {rank}: {name} differs from the one-process replay"
    for p, q in zip(remote_layer.to_here().parameters(), remotes[TRAINERS.index(rank)].parameters()):
        assert torch.allclose(p, q, atol=1e-5), f"rank {rank}: the remote layer differs from the one-process replay"
    if rank != TRAINERS[0]:
        return
    print(f"OK: {steps} steps; trainers' replicas identical and equal to the one-process replay")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != 3:
        raise SystemExit(f"run with --nproc-per-node 3 (two trainers and a parameter server), not {world_size}")
    # The RPC framework meets through torchrun's store too (env://: MASTER_ADDR and MASTER_PORT).
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        train(args.steps)
    finally:
        rpc.shutdown()  # waits for every worker: the server leaves once the trainers are done
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
