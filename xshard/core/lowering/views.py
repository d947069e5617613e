"""View ops as values (the recorder keeps aliasing; here they are plain functions) and scatters."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.table import np_dtype, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


@rule(aten.view.default, aten._unsafe_view, aten.view_copy.default, aten._reshape_alias,
      aten.reshape)
def _view(x, size, *rest):
    return jnp.reshape(x, _infer_shape(tuple(size), x.size))


def _infer_shape(size, numel):
    if -1 in size:
        known = int(np.prod([s for s in size if s != -1])) or 1
        size = tuple(numel // known if s == -1 else s for s in size)
    return size


@rule(aten.view.dtype)
def _view_dtype(x, dtype):
    target = np_dtype(dtype)
    if x.dtype == np.bool_ or target == np.bool_:  # bitcast refuses bools: one byte, 0 or 1
        if target.itemsize == x.dtype.itemsize:
            return x.astype(target) if target != np.bool_ else x != 0
    elif target.itemsize == x.dtype.itemsize:
        return lax.bitcast_convert_type(x, target)
    raise NotImplementedError("view(dtype) between dtypes of different sizes")


@rule(aten.alias, aten.detach, aten.lift_fresh)
def _alias(x):
    return x


@rule(aten.unsqueeze)
def _unsqueeze(x, dim):
    return jnp.expand_dims(x, dim % (x.ndim + 1))


@rule(aten.squeeze.default)
def _squeeze(x):
    return jnp.squeeze(x)


@rule(aten.squeeze.dim)
def _squeeze_dim(x, dim):
    dim = dim % max(x.ndim, 1)
    return jnp.squeeze(x, dim) if x.ndim and x.shape[dim] == 1 else x


@rule(aten.squeeze.dims)
def _squeeze_dims(x, dims):
    dims = tuple(d % max(x.ndim, 1) for d in dims if x.ndim and x.shape[d % x.ndim] == 1)
    return jnp.squeeze(x, dims) if dims else x


@rule(aten.permute)
def _permute(x, dims):
    return jnp.transpose(x, tuple(d % x.ndim for d in dims)) if x.ndim else x


@rule(aten.transpose.int)
def _transpose(x, a, b):
    if x.ndim == 0:
        return x
    return jnp.swapaxes(x, a, b)


@rule(aten.t)
def _t(x):
    return x.T if x.ndim == 2 else x


@rule(aten.expand.default, aten.expand_copy.default)
def _expand(x, size, implicit=False):
    size = tuple(size)
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@rule(aten.select.int, aten.select_copy.int)
def _select(x, dim, index):
    return lax.index_in_dim(x, index % x.shape[dim] if index < 0 else index, dim % x.ndim,
                            keepdims=False)


def _slice_bounds(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    if end - start <= step:
        # At most one element: the same slice with step 1. XLA's SPMD partitioner reads the
        # wrong element of a one-element strided slice of a sharded dim (``x[1:2:3]`` gives x[0];
        # reproduced in plain JAX 0.10.2 with lax.slice and a sharding constraint).
        return start, min(start + 1, end), 1
    return start, end, step


@rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    dim = dim % x.ndim
    start, end, step = _slice_bounds(x.shape[dim], start, end, step)
    return lax.slice_in_dim(x, start, end, step, dim)


@rule(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim1 % x.ndim, dim2 % x.ndim)


@rule(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(x, size, stride, storage_offset=None):
    flat = jnp.ravel(x)
    idx = np.full(tuple(size), storage_offset or 0, np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return flat[jnp.asarray(idx)] if idx.size else jnp.zeros(tuple(size), x.dtype)


@rule(aten.unfold.default)
def _unfold(x, dimension, size, step):
    if x.ndim == 0:  # one window of ``size`` (0 or 1) elements
        return jnp.reshape(x, (1,))[:size]
    dim = dimension % x.ndim
    n = (x.shape[dim] - size) // step + 1
    idx = (np.arange(n)[:, None] * step + np.arange(size)[None, :])
    out = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=dim)
    out = jnp.reshape(out, x.shape[:dim] + (n, size) + x.shape[dim + 1:])
    return jnp.moveaxis(out, dim + 1, -1)


@rule(aten.split.Tensor, aten.split_copy.Tensor, aten.unsafe_split.Tensor)
def _split(x, split_size, dim=0):
    dim = dim % x.ndim
    n = x.shape[dim]
    bounds = list(range(0, n, split_size)) if n else [0]
    return [lax.slice_in_dim(x, s, min(s + split_size, n), 1, dim) for s in bounds]


@rule(aten.split_with_sizes.default, aten.split_with_sizes_copy.default,
      aten.unsafe_split_with_sizes.default)
def _split_with_sizes(x, sizes, dim=0):
    dim = dim % x.ndim
    out, start = [], 0
    for s in sizes:
        out.append(lax.slice_in_dim(x, start, start + s, 1, dim))
        start += s
    return out


@rule(aten.unbind.int, aten.unbind_copy.int)
def _unbind(x, dim=0):
    dim = dim % x.ndim
    return [lax.index_in_dim(x, i, dim, keepdims=False) for i in range(x.shape[dim])]


@rule(aten.slice_scatter)
def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim = dim % x.ndim
    start, end, step = _slice_bounds(x.shape[dim], start, end, step)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, end, step)
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@rule(aten.select_scatter)
def _select_scatter(x, src, dim, index):
    dim = dim % x.ndim
    idx = [slice(None)] * x.ndim
    idx[dim] = index
    return x.at[tuple(idx)].set(src.astype(x.dtype))


@rule(aten.diagonal_scatter)
def _diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = dim1 % x.ndim, dim2 % x.ndim
    n = src.shape[-1]
    i = np.arange(n) + max(-offset, 0)
    j = np.arange(n) + max(offset, 0)
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    moved = moved.at[..., i, j].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


@rule(aten.as_strided_scatter)
def _as_strided_scatter(x, src, size, stride, storage_offset=None):
    idx = np.full(tuple(size), storage_offset or 0, np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    flat = jnp.ravel(x).at[jnp.asarray(idx.reshape(-1))].set(jnp.ravel(src).astype(x.dtype))
    return jnp.reshape(flat, x.shape)
