"""What the distributed-autograd tests share: starting the RPC framework inside a harness worker, and
one training step inside a dist autograd context.

The harness's workers already have the default process group (gloo); the RPC framework gets its own
rendezvous (a free TCP port the test picks), as the issue's users' scripts do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc


def start_rpc(port: int) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=8, rpc_timeout=60
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)


def stop_rpc() -> None:
    rpc.shutdown()


def context_step(
    model: torch.nn.Module,
    batch: Any,
    params: Sequence[torch.Tensor],
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.square().sum(),
    optimizer: Any = None,
) -> list[torch.Tensor | None]:
    """One forward and ``dist_autograd.backward`` in a fresh context: copies of ``params``' gradients
    in the context (None where it holds none); ``optimizer.step(context_id)`` if given."""
    with dist_autograd.context() as context_id:
        loss = loss_fn(model(batch))
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        taken = [None if grads.get(p) is None else grads[p].clone() for p in params]
        if optimizer is not None:
            optimizer.step(context_id)
    return taken


def dense(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else (grad.to_dense() if grad.is_sparse else grad)


def call_method(method: Callable[..., Any], rref: rpc.RRef, *args: Any) -> Any:
    """Run ``method`` on the module an RRef owns, on its owner (torch's ``_call_method`` idiom)."""
    return method(rref.local_value(), *args)


def remote_forward(rref: rpc.RRef, x: torch.Tensor) -> torch.Tensor:
    """The forward of a module that lives on another worker, recorded by distributed autograd."""
    return rpc.rpc_sync(rref.owner(), call_method, args=(torch.nn.Module.__call__, rref, x))
