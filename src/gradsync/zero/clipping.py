"""``clip_grad_norm_`` over shards: the global norm from every rank's pieces, with one scalar collective."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def clip_shards(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """Scale ``grads`` (this rank's pieces; no padding) so that the norm over every rank's is at most ``max_norm``.

    The local sum (or max) is in float64 and all-reduced as one scalar; the coefficient is torch's
    (``clip_grad_norm_``), so the result equals torch's on the full gradient up to the sum order.
    """
    norm_type = float(norm_type)
    if norm_type == math.inf:
        local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
        total = local.reshape(1).to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total = local.reshape(1).to(device)
        dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    norm = total[0].to(grads[0].dtype if grads else torch.float32)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.dtype))
    return norm
