"""Mixed precision for FSDP, as one frozen group of options."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes FSDP computes, reduces and keeps buffers in; parameters stay in their own dtype.

    Attributes:
        param_dtype: dtype parameters are gathered and computed in (None: unchanged).
        reduce_dtype: dtype gradients are reduce-scattered in (None: ``param_dtype``).
        buffer_dtype: dtype buffers are kept in (None: unchanged).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.

    Example:
        >>> MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype)
                                      or not value.is_floating_point):
                raise ValueError(
                    f"MixedPrecision.{name}={value!r} must be a floating-point torch.dtype "
                    f"(e.g. torch.bfloat16, torch.float16, torch.float32) or None.")
