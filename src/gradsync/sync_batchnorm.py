"""SyncBatchNorm: batch normalisation with the statistics of the whole global batch.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors. This one runs on any device and any
backend (gloo on CPU, NCCL on GPU): it needs nothing but ``all_gather`` and
``all_reduce``. In training mode, in a process group of more than one rank, every rank
normalises its shard with the mean and variance of the concatenation of all ranks'
shards, and updates the running statistics from them, exactly as one ``BatchNorm``
over the global batch would. In eval mode, in a group of one, or without
``torch.distributed`` initialised, it is plain ``BatchNorm``.

[Note: one collective each way]
Forward: each rank all-gathers its per-channel ``(count, mean, M2)`` (M2 = sum of
squared deviations from the local mean, in float64) and merges them with Chan's
parallel-variance formula. All-reducing raw sums of ``x`` and ``x**2`` would also be one
collective, but ``E[x**2] - E[x]**2`` cancels catastrophically when ``|mean| >> std``;
the merge has no such cancellation, and the payload (world_size * (2C + 1) doubles) is
negligible. Counts travel with the statistics, so uneven and empty shards just work.
Backward: with ``x̂ = (x - mean) * invstd`` and ``n`` the global count,

    dx = weight * invstd * (dy - Σdy / n - x̂ * Σ(dy·x̂) / n)

where both sums run over the global batch: one all-reduce of ``[Σdy, Σ(dy·x̂)]``.

[Note: gradients under DDP]
DDP averages gradients, so the objective is ``L = (1/W) Σ_r loss_r``. Rank s's output
depends on rank r's input through the shared statistics, so ``∂L/∂x_r`` has a term from
every rank's loss; the all-reduced sums above give ``∂(Σ_s loss_s)/∂x_r = W · ∂L/∂x_r``.
Upstream parameters then get, on rank r, the part of ``∂(Σ_s loss_s)/∂θ`` that flows
through ``x_r``, and DDP's average of those over ranks is exactly ``∂L/∂θ``. The layer's
own weight and bias return their *local* sums ``Σ dy·x̂`` and ``Σ dy``, which DDP's
average turns into ``∂L/∂weight``. All of this needs the forward to be identical on
every rank, which is why the statistics (and so the running buffers) are global.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from .observability.labels import label


class SyncBatchNorm(_BatchNorm):
    """``BatchNorm`` over inputs ``(N, C, *)`` whose training statistics span every rank.

    Same constructor as ``torch.nn.SyncBatchNorm``; ``process_group`` (default: the
    whole world, looked up at forward time) scopes the synchronisation.

    Collective contract: in training mode, each forward issues one ``all_gather`` and
    each backward that needs the input gradient one ``all_reduce``, on
    ``process_group``. So every rank of the group must call forward (and backward) the
    same number of times, in the same order relative to its other collectives, even
    with an empty shard; a rank that skips one hangs the others. Under
    ``DistributedDataParallel.join`` a rank that has run out of data does not run the
    forward, so use ``join(throw_on_early_termination=True)`` and stop every rank when
    the first one runs out. Eval mode issues no collective.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # Older torch has no ``bias`` argument: pass it only when it changes something.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        where = f"{type(self).__name__}(num_features={self.num_features})"
        if input.dim() < 2:
            raise ValueError(
                f"{where} expects input of shape (N, C, *) with at least 2 dims, got shape {tuple(input.shape)}. "
                "Add a batch dimension (e.g. input.unsqueeze(0))."
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{where} got input of shape {tuple(input.shape)} with {input.shape[1]} channels in dim 1, "
                f"expected {self.num_features}. Construct the layer with num_features={input.shape[1]} "
                "or put channels in dim 1."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self._sync_group()
        if group is None:
            return super().forward(input)  # eval mode, or nobody to synchronise with
        factor = self._next_average_factor()
        with torch.no_grad(), label("gradsync::sync_batchnorm_stats"):
            mean, var, count = _global_stats(input, group)
        if input.numel() // input.shape[1] <= 1 and count.item() <= 1:
            # Only ranks with at most one local value ask (no device sync otherwise); if the
            # global count is <= 1, every rank has <= 1 value, so every rank raises.
            raise ValueError(
                f"{type(self).__name__}(num_features={self.num_features}) expected more than 1 value per channel "
                f"in the global batch when training, got {int(count.item())} over all ranks "
                f"(local input shape {tuple(input.shape)}). Use a larger batch or call .eval()."
            )
        if self.track_running_stats:
            self._update_running_stats(mean, var, count, factor)
        invstd = torch.rsqrt(var + self.eps)
        out: torch.Tensor = _SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]  # torch's apply
            input, self.weight, self.bias, mean, invstd, count, group
        )
        return out

    def _sync_group(self) -> dist.ProcessGroup | None:
        """The group to synchronise over, or None when this forward is plain BatchNorm."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _next_average_factor(self) -> float:
        """Count this batch and return its weight in the running statistics (as ``_BatchNorm``)."""
        if not self.track_running_stats:
            return 0.0
        assert self.num_batches_tracked is not None, "track_running_stats=True registers num_batches_tracked"
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, factor: float) -> None:
        assert self.running_mean is not None and self.running_var is not None, "track_running_stats registers them"
        unbiased = var * (count / (count - 1))  # like BatchNorm: unbiased over the global batch
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` (``BatchNorm1d/2d/3d``, torch's or our
        ``SyncBatchNorm``) with ``cls``; returns the module, or a new one if it is a BatchNorm.

        Like torch's version, the new layers *share* the old layers' parameters and
        buffers (weight, bias, running stats, ``num_batches_tracked``), so
        ``requires_grad`` carries over and an optimizer built before the conversion
        still updates them; the training flag is copied. Convert before wrapping in DDP.
        """
        converted = cls._from_batchnorm(module, process_group) if isinstance(module, _BatchNorm) else module
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted

    @classmethod
    def _from_batchnorm(cls, bn: _BatchNorm, process_group: dist.ProcessGroup | None) -> SyncBatchNorm:
        if isinstance(bn, LazyModuleMixin) and bn.has_uninitialized_params():
            raise ValueError(
                f"convert_sync_batchnorm: {type(bn).__name__} has not inferred num_features yet. "
                "Run one forward pass before converting."
            )
        has_bias = not bn.affine or bn.bias is not None
        sync = cls(
            bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group, bias=has_bias
        )
        if bn.affine:
            sync.weight, sync.bias = bn.weight, bn.bias
        sync.running_mean, sync.running_var = bn.running_mean, bn.running_var
        sync.num_batches_tracked = bn.num_batches_tracked
        sync.train(bn.training)
        if hasattr(bn, "qconfig"):
            sync.qconfig = bn.qconfig
        return sync


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dim but the channels: the statistics are per channel."""
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a (C,) vector so that it broadcasts over ``x``'s channel dim."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Half-precision inputs are normalised in float32, as BatchNorm kernels do."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _global_stats(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of the global batch, and its count (float64)."""
    channels = x.shape[1]
    local_count = x.numel() // channels
    if local_count > 0:
        var, mean = torch.var_mean(x.to(_compute_dtype(x)), dim=_reduce_dims(x), correction=0)
        mean, m2 = mean.double(), var.double() * local_count
    else:  # an empty shard still takes part in the collective, with zero weight
        mean = m2 = torch.zeros(channels, dtype=torch.float64, device=x.device)
    count = torch.full((1,), float(local_count), dtype=torch.float64, device=x.device)
    local = torch.cat([count, mean, m2])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    stats = torch.stack(gathered)  # (world, 1 + C + C)
    counts, means, m2s = stats[:, :1], stats[:, 1 : 1 + channels], stats[:, 1 + channels :]
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    # Chan et al.: M2 = Σ M2_r + Σ n_r (mean_r - mean)^2, free of cancellation.
    global_m2 = m2s.sum(0) + (counts * (means - global_mean) ** 2).sum(0)
    return global_mean, global_m2 / total, total


def _normalise(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x̂ = (x - mean) * invstd in ``dtype`` (a fresh tensor, safe to modify in place)."""
    return (x.to(dtype) - _per_channel(mean.to(dtype), x)).mul_(_per_channel(invstd.to(dtype), x))


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = x̂ * weight + bias with given global statistics; backward all-reduces (see the Note)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        # Save x rather than x̂: x is usually alive anyway, x̂ would be a second activation.
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = _normalise(x, mean, invstd, _compute_dtype(x))
        if weight is not None:
            y.mul_(_per_channel(weight.to(y.dtype), x))
        if bias is not None:
            y.add_(_per_channel(bias.to(y.dtype), x))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd, count = ctx.saved_tensors
        dtype = _compute_dtype(x)
        dy = grad_out.to(dtype)
        xhat = _normalise(x, mean, invstd, dtype)
        sum_dy = dy.sum(_reduce_dims(x))
        sum_dy_xhat = (dy * xhat).sum(_reduce_dims(x))
        grad_input = None
        # needs_input_grad is the same on every rank (same model), so all ranks agree on
        # whether this all-reduce happens.
        if ctx.needs_input_grad[0]:
            with label("gradsync::sync_batchnorm_backward"):
                combined = torch.cat([sum_dy, sum_dy_xhat])
                dist.all_reduce(combined, group=ctx.group)
            global_dy, global_dy_xhat = combined.div_(count.to(dtype)).chunk(2)
            scale = invstd.to(dtype) if weight is None else invstd.to(dtype) * weight.to(dtype)
            xhat.mul_(_per_channel(global_dy_xhat, x))
            grad_input = (dy - _per_channel(global_dy, x) - xhat).mul_(_per_channel(scale, x)).to(x.dtype)
        grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None
