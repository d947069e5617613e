"""Type promotion as PyTorch does it, for rules whose jax counterpart promotes differently."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.table import astype, float_dtype, is_weak, np_dtype

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402

aten = torch.ops.aten


_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


def _category(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _BOOL
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _COMPLEX
    if jnp.issubdtype(dtype, jnp.floating):
        return _FLOAT
    return _INT


def result_dtype(*xs):
    """PyTorch's result type: dimensioned tensors > zero-dim tensors > Python scalars (weak)."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    from xshard.core.dtypes import to_torch_dtype

    operands = []
    for x in xs:
        if x is None:
            continue
        if isinstance(x, (bool, int, float, complex)):
            operands.append(x)
        elif is_weak(x):
            operands.append({_BOOL: False, _INT: 0, _FLOAT: 0.0, _COMPLEX: 0j}[_category(x.dtype)])
        else:
            shape = () if jnp.ndim(x) == 0 else (1,)
            operands.append(torch.empty(shape, dtype=to_torch_dtype(x.dtype), device="meta"))
    _, dtype = elementwise_dtypes(
        *operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH)
    dtype = np_dtype(dtype)
    if _category(dtype) == _FLOAT and not any(isinstance(o, torch.Tensor) for o in operands):
        return float_dtype()  # numbers alone: the default dtype's float, or Python's float64
    return dtype


def promote(*xs):
    dtype = result_dtype(*xs)
    return tuple(None if x is None else astype(jnp.asarray(x), dtype) for x in xs)


def promote_float(*xs):
    """``promote`` for ops that compute integers in float (true division, atan2, xlogy): each
    operand converted from its own dtype, as ATen does (``uint8 / -1`` divides by -1.0; converting
    -1 to the promoted uint8 first would divide by 255). Integers: in ``float_dtype()``."""
    dtype = result_dtype(*xs)
    if _category(dtype) in (_BOOL, _INT):
        dtype = float_dtype()
    return tuple(None if x is None else astype(jnp.asarray(x), dtype) for x in xs)


def _compute(x, dtype):
    return jnp.asarray(x, dtype=dtype)


def _float_like(x):
    """Integers and bools computed in float, as PyTorch's unary float ops do (in the default
    dtype: ``float_dtype()``)."""
    if _category(x.dtype) in (_BOOL, _INT):
        return astype(x, float_dtype())
    return x
