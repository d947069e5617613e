"""Shape ops: cat, stack, flip, roll, pad, gather and scatter, indexing, sorting."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.elementwise import _add
from xshard.core.lowering.linalg import _scale
from xshard.core.lowering.promotion import _FLOAT, _INT, _category, result_dtype
from xshard.core.lowering.table import combine, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


@rule(aten.cat)
def _cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors[:1])
    dtype = result_dtype(*tensors)
    return jnp.concatenate([t.astype(dtype) for t in tensors], axis=dim % tensors[0].ndim)


@rule(aten.stack)
def _stack(tensors, dim=0):
    dtype = result_dtype(*tensors)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim % (tensors[0].ndim + 1))


@rule(aten.flip)
def _flip(x, dims):
    return jnp.flip(x, tuple(d % x.ndim for d in dims)) if x.ndim else x


@rule(aten.roll)
def _roll(x, shifts, dims=()):
    if not dims:
        return jnp.reshape(jnp.roll(jnp.ravel(x), shifts[0]), x.shape)
    return jnp.roll(x, tuple(shifts), tuple(dims))


@rule(aten.repeat)
def _repeat(x, repeats):
    repeats = tuple(repeats)
    x = jnp.reshape(x, (1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, repeats)


@rule(aten.constant_pad_nd)
def _constant_pad_nd(x, pad, value=0):
    pads = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        pads[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), pads)


@rule(aten.tril)
def _tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@rule(aten.triu)
def _triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@rule(aten.index_select)
def _index_select(x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index, axis=dim % x.ndim)


@rule(aten.gather)
def _gather(x, dim, index, sparse_grad=False):
    if x.ndim == 0:
        return jnp.reshape(x, index.shape)
    if index.size == 0:  # an empty index may even have another rank
        return jnp.zeros(index.shape, x.dtype)
    dim = dim % x.ndim
    # ``index`` may be smaller than ``x`` along the other dims: gather reads their leading block.
    x = x[tuple(slice(None) if d == dim else slice(0, n) for d, n in enumerate(index.shape))]
    return jnp.take_along_axis(x, index, axis=dim, mode="fill")  # see [Note: indices out of range]


def _as_aten_scatters(rule_fn):
    """A scatter rule, taking its arguments as ATen does: an empty ``index`` (of any rank) writes
    nothing (the result is ``x``), and a 0-dim ``x`` or ``index`` counts as 1-dim (a 0-dim
    ``src``: see ``_covered``)."""
    def lower(x, dim, index, src, *args, **kwargs):
        if index.size == 0:
            return x
        if x.ndim == 0 or index.ndim == 0:
            out = rule_fn(x.reshape(-1), dim, index.reshape(-1), src, *args, **kwargs)
            return out.reshape(x.shape)
        return rule_fn(x, dim, index, src, *args, **kwargs)
    return lower


def _covered(src, index):
    """The leading block of ``src`` that ``index`` covers; a 0-dim ``src`` counts as 1-dim."""
    src = src.reshape(1) if src.ndim == 0 else src
    return src[tuple(slice(0, n) for n in index.shape)]


def _scatter_indices(x, dim, index):
    dim = dim % x.ndim
    grids = jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij")
    grids[dim] = index
    return tuple(grids)


@rule(aten.scatter.src, aten.scatter.value)
@_as_aten_scatters
def _scatter(x, dim, index, src):
    if not hasattr(src, "shape") or jnp.ndim(src) == 0:
        src = jnp.broadcast_to(jnp.asarray(src, x.dtype), index.shape)
    return x.at[_scatter_indices(x, dim, index)].set(_covered(src, index).astype(x.dtype))


@rule(aten.scatter.reduce, aten.scatter.value_reduce)
@_as_aten_scatters
def _scatter_with_reduce(x, dim, index, src, reduce):
    if not hasattr(src, "shape") or jnp.ndim(src) == 0:
        src = jnp.broadcast_to(jnp.asarray(src, x.dtype), index.shape)
    src = _covered(src, index).astype(x.dtype)
    idx = _scatter_indices(x, dim, index)
    if reduce == "add":
        return _scatter_sum(x, idx, src)
    return combine(x, idx, src, "min" if x.dtype == np.bool_ else "multiply")


@rule(aten.put)
def _put(x, index, source, accumulate=False):
    flat = jnp.ravel(x)
    index = jnp.ravel(index)
    index = jnp.where(index < 0, index + flat.size, index)
    source = jnp.ravel(source).astype(x.dtype)
    flat = _scatter_sum(flat, index, source) if accumulate else flat.at[index].set(source)
    return flat.reshape(x.shape)


@rule(aten.masked_scatter)
def _masked_scatter(x, mask, source):
    """The k-th True of ``mask`` takes the k-th element of ``source`` (a cumulative-sum rank)."""
    x, mask = jnp.broadcast_arrays(x, mask)
    flat_source = jnp.ravel(source).astype(x.dtype)
    if flat_source.size == 0:
        return x
    rank = jnp.clip(jnp.cumsum(jnp.ravel(mask).astype(np.int64)) - 1, 0, flat_source.size - 1)
    return jnp.where(mask, flat_source[rank].reshape(x.shape), x)


@rule(aten.scatter_add)
@_as_aten_scatters
def _scatter_add(x, dim, index, src):
    return _scatter_sum(x, _scatter_indices(x, dim, index), _covered(src, index).astype(x.dtype))


@rule(aten.scatter_reduce.two)
@_as_aten_scatters
def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if x.dtype == np.bool_:  # sum is "or", prod is "and": reduce as integers
        return _scatter_reduce(x.astype(np.int32), dim, index, src.astype(np.int32), reduce,
                               include_self) != 0
    src = _covered(src, index).astype(x.dtype)
    idx = _scatter_indices(x, dim, index)
    if reduce == "sum":
        base = x if include_self else x.at[idx].set(0)
        return combine(base, idx, src, "add")
    if reduce == "prod":
        base = x if include_self else x.at[idx].set(1)
        return combine(base, idx, src, "multiply")
    if reduce == "amax":
        base = x if include_self else x.at[idx].set(_lowest(x.dtype))
        return combine(base, idx, src, "max")
    if reduce == "amin":
        base = x if include_self else x.at[idx].set(_highest(x.dtype))
        return combine(base, idx, src, "min")
    if reduce == "mean":
        ones = jnp.ones(index.shape, x.dtype)
        count = combine(jnp.zeros(x.shape, x.dtype), idx, ones, "add") + (1 if include_self else 0)
        total = combine(x if include_self else x.at[idx].set(0), idx, src, "add")
        out = total / jnp.maximum(count, 1)
        if _category(x.dtype) == _INT:
            out = jnp.floor_divide(total, jnp.maximum(count, 1))
        return jnp.where(count > 0, out, x)
    raise NotImplementedError(reduce)


def _lowest(dtype):
    return -jnp.inf if _category(dtype) == _FLOAT else jnp.iinfo(dtype).min


def _highest(dtype):
    return jnp.inf if _category(dtype) == _FLOAT else jnp.iinfo(dtype).max


def _index_tuple(x, indices):
    idx = []
    for i in indices:
        if i is None:
            idx.append(slice(None))
        elif i.dtype == np.bool_:
            raise NotImplementedError("boolean mask indexing has a data-dependent shape")
        else:
            idx.append(i)
    return tuple(idx)


# [Note: indices out of range]
# Eager raises for an index out of range; a compiled program cannot without reading the indices
# back. XLA clamps them into range, which reads another element silently. xshard's gathers fill
# instead (NaN for floats, the dtype's minimum for integers; jnp.take's ``fill``), so a bad index
# shows in the values, as embedding and index_select already did; their backward drops the
# update.
@rule(aten.index.Tensor)
def _index(x, indices):
    return x.at[_index_tuple(x, indices)].get(mode="fill")


@rule(aten.index_put)
def _index_put(x, indices, values, accumulate=False):
    if any(i is not None and i.dtype == np.bool_ for i in indices):
        return _mask_put(x, indices, values, accumulate)
    idx = _index_tuple(x, indices)
    values = values.astype(x.dtype)
    return _scatter_sum(x, idx, values) if accumulate else x.at[idx].set(values)


def _mask_put(x, indices, values, accumulate):
    """``x[..., mask, ...] = values`` with one boolean mask: the k-th True takes the k-th value.

    The number of Trues is data, but ``values`` has a static shape, so each masked element gathers
    its value by its rank among the Trues (a cumulative sum) and the write is a ``where``.
    """
    p = next(n for n, i in enumerate(indices) if i is not None)
    mask = indices[p]
    if any(i is not None for i in indices[p + 1:]) or mask.dtype != np.bool_:
        raise NotImplementedError("index_put mixing a boolean mask with other index tensors")
    before, after = x.shape[:p], x.shape[p + mask.ndim:]
    values = values.astype(x.dtype)
    k = values.shape[values.ndim - len(after) - 1] if values.ndim > len(after) else 1
    if k == 0:  # no values: PyTorch checked that the mask selects nothing
        return x
    values = jnp.broadcast_to(values, before + (k,) + after)
    rank = jnp.clip(jnp.cumsum(mask.ravel().astype(jnp.int32)) - 1, 0, k - 1)
    gathered = jnp.take(values, rank.reshape(mask.shape), axis=p)
    where = mask.reshape((1,) * p + mask.shape + (1,) * len(after))
    return jnp.where(where, x + gathered if accumulate else gathered, x)


@rule(aten.index_fill)
def _index_fill(x, dim, index, value):
    idx = [slice(None)] * x.ndim
    if x.ndim == 0:
        return jnp.asarray(value, x.dtype)
    idx[dim % x.ndim] = index
    return x.at[tuple(idx)].set(jnp.asarray(value, x.dtype))


@rule(aten.index_add)
def _index_add(x, dim, index, source, alpha=1):
    if x.ndim == 0:
        return _add(x, jnp.reshape(source, ()), alpha)
    idx = [slice(None)] * x.ndim
    idx[dim % x.ndim] = index
    source = _scale(source.astype(x.dtype), alpha)
    return _scatter_sum(x, tuple(idx), source)


def _scatter_sum(x, idx, values):
    """``x.at[idx].add(values)``; for bools the sum is a logical or."""
    return combine(x, idx, values, "max" if x.dtype == np.bool_ else "add")


@rule(aten.index_copy)
def _index_copy(x, dim, index, source):
    if x.ndim == 0:
        return source.reshape(())
    idx = [slice(None)] * x.ndim
    idx[dim % x.ndim] = index
    return x.at[tuple(idx)].set(source.astype(x.dtype))


@rule(aten.embedding)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@rule(aten.embedding_dense_backward)
def _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_idx = indices.reshape(-1)
    flat_grad = grad.reshape(-1, grad.shape[-1])
    if padding_idx is not None and padding_idx >= 0:
        flat_grad = jnp.where((flat_idx == padding_idx)[:, None], 0, flat_grad)
    out = combine(jnp.zeros((num_weights, grad.shape[-1]), grad.dtype), flat_idx, flat_grad, "add")
    if scale_grad_by_freq:
        counts = combine(jnp.zeros((num_weights,), grad.dtype), flat_idx, 1, "add")
        out = out / jnp.maximum(counts, 1)[:, None]
    return out
