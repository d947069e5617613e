"""Reductions (sum, mean, var, norms, min/max, cumulative ops, top-k) and softmax."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.promotion import _BOOL, _FLOAT, _INT, _category, _float_like, promote
from xshard.core.lowering.table import HALF_FLOATS, in_float32, keep_nan, np_dtype, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    if isinstance(dim, int):
        dim = (dim,)
    return tuple(d % max(x.ndim, 1) for d in dim) if x.ndim else None


def _acc_dtype(x, dtype):
    if dtype is not None:
        return np_dtype(dtype)
    if _category(x.dtype) in (_BOOL, _INT):
        return np.int64
    return x.dtype


@rule(aten.sum.default, aten.sum.dim_IntList)
def _sum(x, dim=None, keepdim=False, dtype=None):
    acc = _acc_dtype(x, dtype)
    return jnp.sum(x.astype(acc), axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.prod.default, aten.prod.dim_int)
def _prod(x, dim=None, keepdim=False, dtype=None):
    acc = _acc_dtype(x, dtype)
    return jnp.prod(x.astype(acc), axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.mean.default, aten.mean.dim)
def _mean(x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(np_dtype(dtype))
    return jnp.mean(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.amax)
def _amax(x, dim=(), keepdim=False):
    axis = _dims(x, dim)
    return keep_nan(jnp.max(x, axis=axis, keepdims=keepdim), x, axis, keepdim)


@rule(aten.amin)
def _amin(x, dim=(), keepdim=False):
    axis = _dims(x, dim)
    return keep_nan(jnp.min(x, axis=axis, keepdims=keepdim), x, axis, keepdim)


@rule(aten.max.default)
def _max_all(x):
    return keep_nan(jnp.max(x), x)


@rule(aten.min.default)
def _min_all(x):
    return keep_nan(jnp.min(x), x)


@rule(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return keep_nan(jnp.max(x, axis=dim, keepdims=keepdim), x, dim, keepdim), \
        _argmax(x, dim, keepdim)


@rule(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return keep_nan(jnp.min(x, axis=dim, keepdims=keepdim), x, dim, keepdim), \
        _argmin(x, dim, keepdim)


@rule(aten.maximum.default)
def _maximum(a, b):
    a, b = promote(a, b)
    return jnp.maximum(a, b)


@rule(aten.argmax)
def _argmax(x, dim=None, keepdim=False):
    if x.ndim == 0:
        return jnp.zeros((), np.int64)
    if dim is None:
        out = jnp.argmax(jnp.ravel(x))
        return jnp.reshape(out, (1,) * x.ndim) if keepdim else out
    return jnp.argmax(x, axis=dim % x.ndim, keepdims=keepdim).astype(np.int64)


@rule(aten.argmin)
def _argmin(x, dim=None, keepdim=False):
    if x.ndim == 0:
        return jnp.zeros((), np.int64)
    if dim is None:
        out = jnp.argmin(jnp.ravel(x))
        return jnp.reshape(out, (1,) * x.ndim) if keepdim else out
    return jnp.argmin(x, axis=dim % x.ndim, keepdims=keepdim).astype(np.int64)


def _correction(correction, unbiased=None):
    if correction is None:
        return 1 if unbiased is None or unbiased else 0
    return correction


def _variance(x, axis, correction, keepdim, root=False):
    """PyTorch's variance (its square root if ``root``): the sum of squared deviations over
    max(0, N - correction), so a correction of N or more gives inf (NaN where the deviations are
    all 0), where jnp.var gives NaN; no elements give NaN.

    The deviations are scaled by their largest magnitude before squaring, so the standard deviation
    of values beyond 1e19 does not overflow float32 (ATen accumulates in double on CPU). 16-bit
    floats are computed in float32 and rounded once, as ATen does (bfloat16 var of [-1.765625,
    -8.0625] gave 19.75, ATen 19.875)."""
    if x.dtype in HALF_FLOATS:
        return _variance(x.astype(np.float32), axis, correction, keepdim, root).astype(x.dtype)
    n = x.size if axis is None else int(np.prod([x.shape[a] for a in axis]))
    deviations = jnp.abs(x - jnp.mean(x, axis=axis, keepdims=True))
    if n == 0:
        shape = jnp.sum(deviations, axis=axis, keepdims=keepdim).shape
        return jnp.full(shape, jnp.nan, deviations.dtype)
    scale = jnp.max(deviations, axis=axis, keepdims=True)
    safe = jnp.where((scale > 0) & jnp.isfinite(scale), scale, jnp.ones((), scale.dtype))
    squares = jnp.sum(jnp.square(deviations / safe), axis=axis, keepdims=keepdim)
    safe = safe if keepdim else jnp.squeeze(safe, axis=axis)
    # ``correction`` may be a traced scalar input.
    dof = jnp.maximum(jnp.asarray(n, squares.dtype) - _correction(correction), 0)
    ratio = squares / dof.astype(squares.dtype)
    return safe * jnp.sqrt(ratio) if root else jnp.square(safe) * ratio


@rule(aten.var.correction)
def _var(x, dim=None, correction=None, keepdim=False):
    return _variance(x, _dims(x, dim), correction, keepdim)


@rule(aten.std.correction)
def _std(x, dim=None, correction=None, keepdim=False):
    return _variance(x, _dims(x, dim), correction, keepdim, root=True)


@rule(aten.var_mean.correction)
def _var_mean(x, dim=None, correction=None, keepdim=False):
    axis = _dims(x, dim)
    return (_variance(x, axis, correction, keepdim), jnp.mean(x, axis=axis, keepdims=keepdim))


@rule(aten.std_mean.correction)
def _std_mean(x, dim=None, correction=None, keepdim=False):
    axis = _dims(x, dim)
    return (_variance(x, axis, correction, keepdim, root=True),
            jnp.mean(x, axis=axis, keepdims=keepdim))


@rule(aten.any.default, aten.any.dim, aten.any.dims)
def _any(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.all.default, aten.all.dim, aten.all.dims)
def _all(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.logsumexp)
def _logsumexp(x, dim=(), keepdim=False):
    x = _float_like(x)
    return jax.nn.logsumexp(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.linalg_vector_norm)
def _vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = x.astype(np_dtype(dtype))
    axis = _dims(x, dim)
    a = jnp.abs(x)
    if ord == float("inf"):
        return keep_nan(jnp.max(a, axis=axis, keepdims=keepdim), a, axis, keepdim)
    if ord == float("-inf"):
        return keep_nan(jnp.min(a, axis=axis, keepdims=keepdim), a, axis, keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(x.dtype), axis=axis, keepdims=keepdim)
    # float16 / bfloat16 accumulate in float32, as ATen's norms do (|x|**2 of 300 overflows float16)
    out_dtype = a.dtype
    if out_dtype in (jnp.float16, jnp.bfloat16):
        a = a.astype(jnp.float32)
    if ord == 1:
        out = jnp.sum(a, axis=axis, keepdims=keepdim)
    elif ord == 2:
        out = jnp.sqrt(jnp.sum(a * a, axis=axis, keepdims=keepdim))
    else:
        out = jnp.sum(a ** ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)
    return out.astype(out_dtype)


@rule(aten.cumsum)
def _cumsum(x, dim, dtype=None):
    return _scan(jnp.cumsum, x.astype(_acc_dtype(x, dtype)), dim)


@rule(aten.cumprod)
def _cumprod(x, dim, dtype=None):
    return _scan(jnp.cumprod, x.astype(_acc_dtype(x, dtype)), dim)


@rule(aten.logcumsumexp)
def _logcumsumexp(x, dim):
    return _scan(lambda v, axis: lax.cumlogsumexp(v, axis=axis), x, dim)


def _scan(fn, x, dim):
    """A running ``fn`` along ``dim``; 16-bit floats run in float32 and round each result, as
    ATen accumulates them (a bfloat16 running sum rounds every partial sum: 1 in 64 off)."""
    if x.ndim == 0:
        return x
    return in_float32(fn)(x, axis=dim % x.ndim)


def _cum_extreme(x, dim, better):
    """Running max/min with the index of its latest occurrence; NaN wins and stays (as in ATen)."""
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    dim = dim % x.ndim
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    idx = jnp.broadcast_to(jnp.arange(x.shape[dim], dtype=np.int64).reshape(shape), x.shape)

    def combine(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = better(vb, va) | (vb == va)
        if _category(x.dtype) == _FLOAT:
            take_b = jnp.isnan(vb) | (~jnp.isnan(va) & take_b)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (x, idx), axis=dim)


@rule(aten.cummax)
def _cummax(x, dim):
    return _cum_extreme(x, dim, jnp.greater)


@rule(aten.cummin)
def _cummin(x, dim):
    return _cum_extreme(x, dim, jnp.less)


def _empty_median(x):
    """The median of no values: NaN, or an integer dtype's lowest value (eager converts a NaN)."""
    return jnp.asarray(jnp.nan if _category(x.dtype) == _FLOAT else
                       False if x.dtype == np.bool_ else jnp.iinfo(x.dtype).min, x.dtype)


@rule(aten.median.default)
def _median(x):
    if x.size == 0:
        return _empty_median(x)
    flat = jnp.sort(jnp.ravel(x))  # NaNs sort last
    value = flat[(flat.size - 1) // 2]
    if _category(x.dtype) == _FLOAT:
        value = jnp.where(jnp.any(jnp.isnan(flat)), jnp.nan, value)
    return value


@rule(aten.nanmedian.default)
def _nanmedian(x):
    if x.size == 0:
        return _empty_median(x)
    flat = jnp.sort(jnp.ravel(x))
    if _category(x.dtype) != _FLOAT:
        return flat[(flat.size - 1) // 2]
    count = jnp.sum(~jnp.isnan(flat))
    return jnp.where(count > 0, flat[jnp.maximum(count - 1, 0) // 2], jnp.nan)


@rule(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(sorted_sequence, values, out_int32=False, right=False, side=None, sorter=None):
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    side = side or ("right" if right else "left")
    values = jnp.asarray(values)
    dtype = np.int32 if out_int32 else np.int64
    if seq.ndim == 1:
        return jnp.searchsorted(seq, values, side=side).astype(dtype)
    lead = seq.shape[:-1]
    flat_seq = seq.reshape((-1, seq.shape[-1]))
    flat_values = values.reshape((flat_seq.shape[0], -1))
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_values)
    return out.reshape(lead + values.shape[-1:]).astype(dtype)


def _reversed_order(x):
    """A key that sorts ``x``'s elements in the opposite order: ``-x`` for floats (NaN stays NaN),
    ``~x`` for integers and bools (``-x`` overflows at the most negative value, and for unsigned
    ones keeps 0 at the bottom: a descending uint8 sort put 0 first)."""
    return -x if _category(x.dtype) == _FLOAT else ~x


@rule(aten.sort.default, aten.sort.stable)
def _sort(x, *args, stable=None, dim=-1, descending=False):
    if args:
        dim = args[0]
        descending = args[1] if len(args) > 1 else descending
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    dim = dim % x.ndim
    idx = jnp.argsort(_reversed_order(x) if descending else x, axis=dim, stable=True)
    if descending and _category(x.dtype) == _FLOAT:
        # NaN sorts first when descending, last when ascending (as in PyTorch).
        idx = jnp.take_along_axis(idx, jnp.argsort(jnp.take_along_axis(
            ~jnp.isnan(x), idx, axis=dim), axis=dim, stable=True), axis=dim)
    return jnp.take_along_axis(x, idx, axis=dim), idx.astype(np.int64)


def _order_key(x):
    """Integers ordered as floats ``x`` are in PyTorch, every NaN above +inf: ``lax.top_k``
    ranks a NaN with its sign bit set (what XLA's ``sqrt`` and ``log`` of a negative give) below
    every number, so ``sqrt(x).topk(k)`` left the NaNs out."""
    bits = {2: np.int16, 4: np.int32, 8: np.int64}[x.dtype.itemsize]
    b = lax.bitcast_convert_type(x, bits)
    b = jnp.where(jnp.isnan(x), jnp.array(np.iinfo(bits).max, bits), b)
    # Negative floats' bits count up as the floats go down: flip all but the sign bit.
    return b ^ ((b >> (8 * x.dtype.itemsize - 1)) & np.iinfo(bits).max)


@rule(aten.topk)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    dim = dim % x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    key = _order_key(moved) if _category(x.dtype) == _FLOAT else moved
    _, idx = lax.top_k(key if largest else _reversed_order(key), k)
    vals = jnp.take_along_axis(moved, idx, axis=-1)
    return jnp.moveaxis(vals, -1, dim), jnp.moveaxis(idx, -1, dim).astype(np.int64)





def _along(fn, x, dim):
    """``fn(x, axis=dim)``; a 0-dim ``x`` counts as one element along its one dim, as in PyTorch."""
    if x.ndim == 0:
        return fn(x.reshape(1), axis=0).reshape(())
    return fn(x, axis=dim % x.ndim)


@rule(aten._softmax)
@in_float32
def _softmax(x, dim, half_to_float=False):
    return _along(jax.nn.softmax, x.astype(np.float32) if half_to_float else x, dim)


@rule(aten._log_softmax)
def _log_softmax(x, dim, half_to_float=False):
    if x.dtype in HALF_FLOATS and not half_to_float and (x.ndim == 0 or dim % x.ndim == x.ndim - 1):
        return _along(_log_softmax_16_last, x, -1)
    return in_float32(_log_softmax_float)(x, dim, half_to_float)


def _log_softmax_float(x, dim, half_to_float):
    return _along(jax.nn.log_softmax, x.astype(np.float32) if half_to_float else x, dim)


def _log_softmax_16_last(x, axis):
    """ATen's CPU kernel along the last dimension of a 16-bit tensor: (x - max) - log(sum) in
    float32, with the sum of exponentials and its log each kept in the 16-bit dtype (so a logit
    far above the others has log-probability 0, not -2e-3)."""
    half = x.dtype
    xf = x.astype(np.float32)
    shifted = xf - jnp.max(xf, axis=axis, keepdims=True)
    total = jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True).astype(half).astype(np.float32)
    return (shifted - jnp.log(total).astype(half).astype(np.float32)).astype(half)


@rule(aten._softmax_backward_data)
@in_float32
def _softmax_backward_data(grad, out, dim, input_dtype):
    axis = dim % out.ndim if out.ndim else None  # 0-dim: the sum over its one element
    return out * (grad - jnp.sum(grad * out, axis=axis, keepdims=True))


@rule(aten._log_softmax_backward_data)
@in_float32
def _log_softmax_backward_data(grad, out, dim, input_dtype):
    axis = dim % out.ndim if out.ndim else None
    return grad - jnp.exp(out) * jnp.sum(grad, axis=axis, keepdims=True)
