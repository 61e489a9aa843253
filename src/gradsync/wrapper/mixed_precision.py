"""``mixed_precision``: forward in a low precision, gradients reduced in ``reduce_dtype``, fp32 master weights.

torch's experimental ``_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` swaps every
parameter's storage for a low-precision copy around forward and backward and needs CUDA
streams and events (on CPU it fails: "cpu backend doesn't support events"). gradsync keeps
the contract and reaches it without swapping anything:

- The module runs on low-precision copies of its parameters, made by differentiable casts
  (``torch.func.functional_call``). Autograd carries each gradient back through its cast, so
  ``.grad`` is a full-precision tensor holding the low-precision gradient's value: accumulation
  under ``no_sync`` happens in full precision and the optimizer steps the fp32 master weights,
  which are what ``state_dict`` saves.
- The buckets' flat buffers are in ``reduce_dtype`` (default: ``param_dtype``, else the
  parameters' own): gradients are rounded to it, averaged in it, and written back to ``.grad``.
- Floating-point buffers are cast to ``buffer_dtype`` once at construction and floating-point
  inputs to ``param_dtype`` before each forward, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map


class MixedPrecision:
    """One wrapped module's mixed-precision settings and the forward that applies them."""

    def __init__(self, config: Any, module: nn.Module, ignored: set[str]) -> None:
        fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
        if not all(hasattr(config, field) for field in fields):
            raise TypeError(
                f"mixed_precision must have param_dtype, reduce_dtype and buffer_dtype, got {config!r}. Pass "
                "torch.nn.parallel.distributed._MixedPrecision(param_dtype=torch.bfloat16, ...)."
            )
        for field in fields:
            value = getattr(config, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(
                    f"mixed_precision.{field} must be a floating torch.dtype or None, got {value!r}. Pass "
                    "torch.nn.parallel.distributed._MixedPrecision(param_dtype=torch.bfloat16, ...)."
                )
        self.param_dtype: torch.dtype | None = getattr(config, "param_dtype", None)
        self.reduce_dtype: torch.dtype | None = getattr(config, "reduce_dtype", None) or self.param_dtype
        self.buffer_dtype: torch.dtype | None = getattr(config, "buffer_dtype", None)
        # Every floating parameter is computed in param_dtype, frozen ones too (as torch);
        # shared parameters appear once and functional_call ties their other names.
        self._cast = [(n, p) for n, p in module.named_parameters() if n not in ignored and p.is_floating_point()]
        if self.buffer_dtype is not None:
            for name, buffer in module.named_buffers():
                if name not in ignored and buffer.is_floating_point():
                    buffer.data = buffer.data.to(self.buffer_dtype)

    def cast_inputs(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.param_dtype is None:
            return inputs, kwargs
        dtype = self.param_dtype

        def cast(value: Any) -> Any:
            return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        return tree_map(cast, inputs), tree_map(cast, kwargs)

    def run(self, module: nn.Module, inputs: Any, kwargs: Any) -> Any:
        """``module(*inputs, **kwargs)`` with its parameters cast to ``param_dtype``."""
        if self.param_dtype is None:
            return module(*inputs, **kwargs)
        low = {name: param.to(self.param_dtype) for name, param in self._cast}
        return torch.func.functional_call(module, low, tuple(inputs), kwargs, tie_weights=True, strict=False)
