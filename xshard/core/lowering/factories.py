"""Factories: zeros, ones, full, arange, eye, linspace... (shapes and dtypes static)."""

from __future__ import annotations

import math

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.promotion import _FLOAT, _INT, _category
from xshard.core.lowering.table import astype, np_dtype, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402

aten = torch.ops.aten


@rule(aten.empty.memory_format, aten.zeros.default, aten._efficientzerotensor.default)
def _zeros(size, dtype=None, **kwargs):
    return jnp.zeros(tuple(size), np_dtype(dtype))


@rule(aten.empty_strided)
def _empty_strided(size, stride, dtype=None, **kwargs):
    return jnp.zeros(tuple(size), np_dtype(dtype))


@rule(aten.ones.default)
def _ones(size, dtype=None, **kwargs):
    return jnp.ones(tuple(size), np_dtype(dtype))


@rule(aten.full.default)
def _full(size, fill_value, dtype=None, **kwargs):
    return jnp.full(tuple(size), fill_value, np_dtype(dtype))


@rule(aten.empty_like.default, aten.zeros_like.default)
def _zeros_like(x, dtype=None, **kwargs):
    return jnp.zeros(x.shape, np_dtype(dtype) if dtype is not None else x.dtype)


@rule(aten.ones_like.default)
def _ones_like(x, dtype=None, **kwargs):
    return jnp.ones(x.shape, np_dtype(dtype) if dtype is not None else x.dtype)


@rule(aten.full_like.default)
def _full_like(x, fill_value, dtype=None, **kwargs):
    return jnp.full(x.shape, fill_value, np_dtype(dtype) if dtype is not None else x.dtype)


@rule(aten.scalar_tensor.default)
def _scalar_tensor(value, dtype=None, **kwargs):
    return jnp.asarray(value, np_dtype(dtype))


@rule(aten.arange.start_step)
def _arange(start, end, step=1, dtype=None, **kwargs):
    dtype = np_dtype(dtype)
    sized = (start, end, step)
    if _category(dtype) < _FLOAT:
        # The values step from the start and step converted to integers. ATen sizes an int64
        # arange from its converted bounds and step too, any other integer dtype's from them as
        # given: arange(0.5, 7.3, 1.5) has 7 int64 elements, 5 int8 ones.
        start, step = int(start), int(step)
        if dtype == np.int64:
            sized = (start, int(end), step)
    n = int(math.ceil((sized[1] - sized[0]) / sized[2]))
    return _plus(start, jnp.arange(max(n, 0), dtype=np.float64 if _category(dtype) >= _FLOAT
                                   else np.int64) * step).astype(dtype)


def _plus(start, x):
    """``start + x`` for a Python number ``start``, as ATen computes it: XLA rewrites ``0.0 + x``
    to ``x``, which kept a -0.0 of ``x`` (``arange(0.0, -1.0, -0.25)[0]`` was -0.0; ATen: 0.0)."""
    if isinstance(start, float) and start == 0 and math.copysign(1.0, start) > 0:
        return jnp.where(x == 0, jnp.zeros((), x.dtype), x)
    return start + x


@rule(aten.tril_indices.default)
def _tril_indices(row, col, offset=0, dtype=None, **kwargs):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)), np_dtype(dtype))


@rule(aten.triu_indices.default)
def _triu_indices(row, col, offset=0, dtype=None, **kwargs):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)), np_dtype(dtype))


@rule(aten.eye.default)
def _eye(n, dtype=None, **kwargs):
    return _eye_m(n, n, dtype)


@rule(aten.eye.m)
def _eye_m(n, m, dtype=None, **kwargs):
    # Not jnp.eye: it converts the diagonal mask (see ``astype``), and XLA then turned
    # ``eye / 0`` into 0 off the diagonal where PyTorch gives NaN.
    diagonal = jax.lax.broadcasted_iota(np.int32, (n, m), 0) == \
        jax.lax.broadcasted_iota(np.int32, (n, m), 1)
    return astype(diagonal, np_dtype(dtype))


def _integer_ends(start, end, dtype):
    """ATen's integer linspace / logspace first cast their ends to the dtype (truncating)."""
    if _category(np_dtype(dtype)) == _INT:
        return math.trunc(start), math.trunc(end)
    return start, end


@rule(aten.linspace.default)
def _linspace(start, end, steps, dtype=None, **kwargs):
    start, end = _integer_ends(start, end, dtype)
    dtype = np_dtype(dtype)
    if steps == 1:
        return jnp.full((1,), start, dtype)
    step = (end - start) / (steps - 1)
    idx = jnp.arange(steps, dtype=np.float64)
    half = steps // 2
    out = jnp.where(idx < half, _plus(start, step * idx), end - step * (steps - 1 - idx))
    if _category(dtype) == _INT:
        out = jnp.trunc(out)
    return out.astype(dtype)


@rule(aten.logspace.default)
def _logspace(start, end, steps, base=10.0, dtype=None, **kwargs):
    if steps > 1:  # one step is base ** start, start as given
        start, end = _integer_ends(start, end, dtype)
    return jnp.power(base, _linspace(start, end, steps, dtype=torch.float64)).astype(
        np_dtype(dtype))
