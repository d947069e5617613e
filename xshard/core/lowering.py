"""The lowering table: one rule per aten overload, turning an IR node into jax.lax / jax.numpy calls.

A rule is called while JAX traces the graph: tensor arguments arrive as ``jax.Array`` tracers,
dynamic Python scalars as weakly typed 0-d tracers (so they promote like PyTorch's wrapped numbers),
static arguments as the Python values of the call. Random ops get one extra keyword, ``_key``: raw
threefry key data drawn from the device's RNG stream. A rule returns an array, or a tuple/list for
multi-output ops. The graph driver casts each result to the dtype PyTorch's meta kernel promised, so
rules need not restate PyTorch's type promotion where JAX's agrees up to the final cast.

Rules are registered with ``@rule(aten.op.overload, ...)`` (an ``OpOverloadPacket`` registers all its
overloads). The table is keyed by overload; ``RULES[op]`` is looked up once per op at graph build time.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.dtypes import to_numpy_dtype

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten
RULES: dict = {}


def rule(*ops):
    def register(fn):
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    RULES.setdefault(getattr(op, name), fn)
            else:
                RULES[op] = fn
        return fn
    return register


def has_rule(op) -> bool:
    return op in RULES


def np_dtype(dtype: torch.dtype):
    return to_numpy_dtype(dtype)


# -- promotion as PyTorch does it ----------------------------------------------------------------

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


def _is_weak(x) -> bool:
    return getattr(x, "weak_type", False) or isinstance(x, (bool, int, float, complex))


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
        elif _is_weak(x):
            operands.append({_BOOL: False, _INT: 0, _FLOAT: 0.0, _COMPLEX: 0j}[_category(x.dtype)])
        else:
            shape = () if jnp.ndim(x) == 0 else (1,)
            operands.append(torch.empty(shape, dtype=to_torch_dtype(x.dtype), device="meta"))
    _, dtype = elementwise_dtypes(
        *operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH)
    return np_dtype(dtype)


def promote(*xs):
    dtype = result_dtype(*xs)
    return tuple(None if x is None else jnp.asarray(x, dtype=dtype) for x in xs)


def _compute(x, dtype):
    return jnp.asarray(x, dtype=dtype)


def _float_like(x):
    """Integers and bools computed in float, as PyTorch's unary float ops do (default float32)."""
    if _category(x.dtype) in (_BOOL, _INT):
        return x.astype(jnp.float32)
    return x


# -- elementwise ------------------------------------------------------------------------------------


def _unary_float(fn):
    def lower(x, *args, **kwargs):
        return fn(_float_like(x))
    return lower


_UNARY_FLOAT = {
    aten.exp: jnp.exp, aten.exp2: jnp.exp2, aten.expm1: jnp.expm1, aten.log: jnp.log,
    aten.log2: jnp.log2, aten.log10: jnp.log10, aten.log1p: jnp.log1p, aten.sqrt: jnp.sqrt,
    aten.rsqrt: lax.rsqrt, aten.sin: jnp.sin, aten.cos: jnp.cos, aten.tan: jnp.tan,
    aten.asin: jnp.arcsin, aten.acos: jnp.arccos, aten.atan: jnp.arctan, aten.sinh: jnp.sinh,
    aten.cosh: jnp.cosh, aten.tanh: jnp.tanh, aten.asinh: jnp.arcsinh, aten.acosh: jnp.arccosh,
    aten.atanh: jnp.arctanh, aten.sigmoid: jax.nn.sigmoid, aten.erf: jax.scipy.special.erf,
    aten.erfc: jax.scipy.special.erfc, aten.erfinv: jax.scipy.special.erfinv,
    aten.lgamma: jax.scipy.special.gammaln,
    aten.digamma: lambda x: jnp.where(x == 0, -jnp.inf, jax.scipy.special.digamma(x)),
    aten.i0: jax.scipy.special.i0, aten.special_i0e: jax.scipy.special.i0e,
    aten.special_i1: jax.scipy.special.i1, aten.special_i1e: jax.scipy.special.i1e,
    aten.reciprocal: jnp.reciprocal, aten.deg2rad: jnp.deg2rad, aten.rad2deg: jnp.rad2deg,
    aten.sinc: jnp.sinc, aten.special_erfcx: jax.scipy.special.erfcx,
    aten.special_ndtri: jax.scipy.special.ndtri, aten.special_ndtr: jax.scipy.special.ndtr,
    aten.special_log_ndtr: jax.scipy.special.log_ndtr,
    aten.special_entr: jax.scipy.special.entr,
}
for _op, _fn in _UNARY_FLOAT.items():
    rule(_op)(_unary_float(_fn))

_UNARY_SAME = {
    aten.neg: jnp.negative, aten.abs: jnp.abs, aten.floor: jnp.floor, aten.ceil: jnp.ceil,
    aten.trunc: jnp.trunc, aten.sign: jnp.sign, aten.bitwise_not: lambda x: ~x,
    aten.positive: lambda x: x, aten.square: lambda x: x * x,
}
# Identities on bools (all but bitwise_not/square) and, for rounding, on integers.
_IDENTITY_ON_INT = {aten.floor, aten.ceil, aten.trunc}


def _unary_same(op, fn):
    def lower(x):
        if x.dtype == np.bool_ and op not in (aten.bitwise_not, aten.square):
            return x
        if op in _IDENTITY_ON_INT and _category(x.dtype) != _FLOAT:
            return x
        return fn(x)
    return lower


for _op, _fn in _UNARY_SAME.items():
    rule(_op)(_unary_same(_op, _fn))


@rule(aten.round.default)
def _round(x):
    return jnp.round(x) if _category(x.dtype) == _FLOAT else x


@rule(aten.round.decimals)
def _round_decimals(x, decimals=0):
    scale = 10.0 ** decimals
    return jnp.round(x * scale) / scale


@rule(aten.frac)
def _frac(x):
    return x - jnp.trunc(x)


@rule(aten.sgn)
def _sgn(x):
    return x if x.dtype == np.bool_ else jnp.sign(x)


# One-argument ops whose jax.numpy function already has PyTorch's semantics.
_UNARY_DIRECT = {
    aten.logical_not: jnp.logical_not, aten.isnan: jnp.isnan, aten.isinf: jnp.isinf,
    aten.isfinite: jnp.isfinite, aten.signbit: jnp.signbit, aten.isneginf: jnp.isneginf,
    aten.isposinf: jnp.isposinf,
}
for _op, _fn in _UNARY_DIRECT.items():
    rule(_op)(lambda x, _fn=_fn: _fn(x))


@rule(aten.relu)
def _relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@rule(aten.gelu)
def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@rule(aten.gelu_backward)
def _gelu_backward(grad, x, approximate="none"):
    _, vjp = jax.vjp(lambda v: jax.nn.gelu(v, approximate=approximate == "tanh"), x)
    return vjp(grad)[0]


@rule(aten.silu)
def _silu(x):
    return x * jax.nn.sigmoid(x)


@rule(aten.silu_backward)
def _silu_backward(grad, x):
    s = jax.nn.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


@rule(aten.mish)
def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@rule(aten.sigmoid_backward)
def _sigmoid_backward(grad, out):
    return grad * out * (1 - out)


@rule(aten.tanh_backward)
def _tanh_backward(grad, out):
    return grad * (1 - out * out)


@rule(aten.softplus)
def _softplus(x, beta=1, threshold=20):
    bx = x * beta
    return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


@rule(aten.hardtanh)
def _hardtanh(x, min_val=-1, max_val=1):
    return jnp.clip(x, min_val, max_val)


@rule(aten.hardtanh_backward)
def _hardtanh_backward(grad, x, min_val, max_val):
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros((), grad.dtype), grad)


@rule(aten.leaky_relu)
def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@rule(aten.leaky_relu_backward)
def _leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@rule(aten.elu)
def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, (jnp.expm1(x * input_scale)) * alpha * scale)


@rule(aten.hardsigmoid)
def _hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@rule(aten.hardswish)
def _hardswish(x):
    return x * jnp.clip(x / 6 + 0.5, 0, 1)


@rule(aten.threshold)
def _threshold(x, threshold, value):
    return jnp.where(x <= threshold, jnp.asarray(value, x.dtype), x)


@rule(aten.threshold_backward)
def _threshold_backward(grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


@rule(aten.igamma, torch.ops.prims.igamma.default)
def _igamma(a, x):
    a, x = promote(a, x)
    return jax.scipy.special.gammainc(_float_like(a), _float_like(x))


@rule(aten.igammac, torch.ops.prims.igammac.default)
def _igammac(a, x):
    a, x = promote(a, x)
    return jax.scipy.special.gammaincc(_float_like(a), _float_like(x))


@rule(aten.special_modified_bessel_i0)
def _bessel_i0(x):
    return jax.scipy.special.i0(_float_like(x))


@rule(aten.special_modified_bessel_i1)
def _bessel_i1(x):
    return jax.scipy.special.i1(_float_like(x))


@rule(torch.ops.prims.spherical_bessel_j0.default)
def _spherical_bessel_j0(x):
    x = _float_like(x)
    safe = jnp.where(x == 0, jnp.ones((), x.dtype), x)
    return jnp.where(x == 0, jnp.ones((), x.dtype), jnp.sin(safe) / safe)


@rule(aten.gcd, torch.ops.prims.gcd.default)
def _gcd(a, b):
    return jnp.gcd(*promote(a, b))


@rule(aten.lcm)
def _lcm(a, b):
    return jnp.lcm(*promote(a, b))


@rule(torch.ops.prims.div.default)
def _prims_div(a, b):
    a, b = promote(a, b)
    if _category(a.dtype) in (_INT, _BOOL):
        return lax.div(*jnp.broadcast_arrays(a, b))
    return a / b


@rule(torch.ops.prims.frexp.default, aten.frexp.Tensor)
def _frexp(x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(np.int32)


@rule(aten.angle)
def _angle(x):
    if _category(x.dtype) == _COMPLEX:
        return jnp.angle(x)
    x = _float_like(x)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(np.pi, x.dtype),
                                                 jnp.zeros((), x.dtype)))


@rule(aten.logit)
def _logit(x, eps=None):
    x = _float_like(x)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@rule(aten.nan_to_num)
def _nan_to_num(x, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


def _binary(fn, float_only=False):
    def lower(a, b, *rest, **kwargs):
        a, b = promote(a, b)
        if float_only:
            a, b = _float_like(a), _float_like(b)
        return fn(a, b)
    return lower


_BINARY = {
    aten.mul: jnp.multiply, aten.maximum: jnp.maximum, aten.minimum: jnp.minimum,
    aten.fmax: jnp.fmax, aten.fmin: jnp.fmin, aten.eq: jnp.equal, aten.ne: jnp.not_equal,
    aten.lt: jnp.less, aten.le: jnp.less_equal, aten.gt: jnp.greater, aten.ge: jnp.greater_equal,
    aten.logical_and: jnp.logical_and, aten.logical_or: jnp.logical_or,
    aten.logical_xor: jnp.logical_xor, aten.bitwise_and: jnp.bitwise_and,
    aten.bitwise_or: jnp.bitwise_or, aten.bitwise_xor: jnp.bitwise_xor,
    aten.bitwise_left_shift: jnp.left_shift, aten.bitwise_right_shift: jnp.right_shift,
    aten.__lshift__: jnp.left_shift, aten.__rshift__: jnp.right_shift,
    aten.heaviside: jnp.heaviside,
}
for _op, _fn in _BINARY.items():
    rule(_op)(_binary(_fn))

for _op, _fn in {aten.atan2: jnp.arctan2, aten.hypot: jnp.hypot, aten.copysign: jnp.copysign,
                 aten.nextafter: jnp.nextafter, aten.logaddexp: jnp.logaddexp,
                 aten.logaddexp2: jnp.logaddexp2,
                 aten.xlogy: jax.scipy.special.xlogy,
                 aten.special_xlog1py: jax.scipy.special.xlog1py}.items():
    rule(_op)(_binary(_fn, float_only=True))


@rule(aten.add)
def _add(a, b, alpha=1):
    a, b = promote(a, b)
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha == 1):
        b = b * jnp.asarray(alpha, b.dtype)
    if a.dtype == np.bool_:
        return a | b
    return a + b


@rule(aten.sub)
def _sub(a, b, alpha=1):
    a, b = promote(a, b)
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        b = b * jnp.asarray(alpha, b.dtype)
    return a - b


@rule(aten.rsub)
def _rsub(a, b, alpha=1):
    return _sub(b, a, alpha)


@rule(aten.div)
def _div(a, b, rounding_mode=None):
    a, b = promote(a, b)
    if rounding_mode is None:
        a, b = _float_like(a), _float_like(b)
        return a / b
    if rounding_mode == "trunc":
        if _category(a.dtype) == _INT:
            a, b = jnp.broadcast_arrays(a, b)
            return lax.div(a, b)
        return jnp.trunc(a / b)
    return _floor_divide(a, b)


@rule(aten.floor_divide)
def _floor_divide(a, b):
    a, b = promote(a, b)
    if _category(a.dtype) == _INT:
        return jnp.floor_divide(a, b)
    return jnp.floor(a / b)


@rule(aten.remainder)
def _remainder(a, b):
    a, b = promote(a, b)
    return jnp.remainder(a, b)


@rule(aten.fmod)
def _fmod(a, b):
    a, b = promote(a, b)
    return jnp.fmod(a, b)


@rule(aten.pow)
def _pow(a, b):
    if isinstance(b, (int, float)) and not isinstance(b, bool) and hasattr(a, "dtype"):
        if float(b) == int(b) and abs(b) <= 4 and (b >= 0 or _category(a.dtype) >= _FLOAT):
            return lax.integer_pow(_compute(a, result_dtype(a, b)), int(b))
    a, b = promote(a, b)
    if _category(a.dtype) == _INT:
        return _int_pow(a, b)
    return jnp.power(a, b)


def _int_pow(a, b):
    """Integer powers: a negative exponent gives 0 unless the base is 1 or -1 (as in ATen)."""
    a, b = jnp.broadcast_arrays(a, b)
    positive = jnp.power(a, jnp.maximum(b, 0))
    one = jnp.ones((), a.dtype)
    negative = jnp.where(a == 1, one, jnp.where(a == -1, jnp.where(b % 2 == 0, one, -one),
                                                 jnp.zeros((), a.dtype)))
    return jnp.where(b < 0, negative, positive)


@rule(aten.where)
def _where(cond, a=None, b=None):
    a, b = promote(a, b)
    return jnp.where(cond, a, b)


@rule(aten.clamp, aten.clip)
def _clamp(x, min=None, max=None):
    dtype = result_dtype(x, min, max)
    x = x.astype(dtype)
    if min is not None:
        x = jnp.maximum(x, jnp.asarray(min, dtype))
    if max is not None:
        x = jnp.minimum(x, jnp.asarray(max, dtype))
    return x


@rule(aten.clamp_min)
def _clamp_min(x, min):
    return _clamp(x, min=min)


@rule(aten.clamp_max)
def _clamp_max(x, max):
    return _clamp(x, max=max)


@rule(aten.lerp)
def _lerp(start, end, weight):
    start, end, weight = promote(start, end, weight)
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start),
                     end - (end - start) * (1 - weight))


@rule(aten.addcmul)
def _addcmul(x, t1, t2, value=1):
    x, t1, t2 = promote(x, t1, t2)
    return x + jnp.asarray(value, x.dtype) * t1 * t2


@rule(aten.addcdiv)
def _addcdiv(x, t1, t2, value=1):
    x, t1, t2 = promote(x, t1, t2)
    return x + jnp.asarray(value, x.dtype) * (t1 / t2)


@rule(aten.fill.Scalar, aten.fill.Tensor)
def _fill(x, value):
    return jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape)


@rule(aten.zero)
def _zero(x):
    return jnp.zeros(x.shape, x.dtype)


@rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


@rule(aten.clone, aten.lift_fresh_copy, aten.alias_copy, aten.detach_copy, aten.contiguous)
def _clone(x, *args, **kwargs):
    return x


@rule(aten.copy)
def _copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


@rule(aten._to_copy)
def _to_copy(x, dtype=None, **kwargs):
    if dtype is None:
        return x
    target = np_dtype(dtype)
    if _category(x.dtype) == _COMPLEX and _category(target) != _COMPLEX:
        x = jnp.real(x)
    if target == np.bool_:
        return x != 0
    return x.astype(target)


# -- factories ---------------------------------------------------------------------------------


@rule(aten.empty.memory_format, aten.zeros.default)
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
    n = int(math.ceil((end - start) / step))
    return (start + jnp.arange(max(n, 0), dtype=np.float64 if _category(dtype) >= _FLOAT
                               else np.int64) * step).astype(dtype)


@rule(aten.tril_indices.default)
def _tril_indices(row, col, offset=0, dtype=None, **kwargs):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)), np_dtype(dtype))


@rule(aten.triu_indices.default)
def _triu_indices(row, col, offset=0, dtype=None, **kwargs):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)), np_dtype(dtype))


@rule(aten.eye.default)
def _eye(n, dtype=None, **kwargs):
    return jnp.eye(n, dtype=np_dtype(dtype))


@rule(aten.eye.m)
def _eye_m(n, m, dtype=None, **kwargs):
    return jnp.eye(n, m, dtype=np_dtype(dtype))


@rule(aten.linspace.default)
def _linspace(start, end, steps, dtype=None, **kwargs):
    dtype = np_dtype(dtype)
    if steps == 1:
        return jnp.full((1,), start, dtype)
    step = (end - start) / (steps - 1)
    idx = jnp.arange(steps, dtype=np.float64)
    half = steps // 2
    out = jnp.where(idx < half, start + step * idx, end - step * (steps - 1 - idx))
    if _category(dtype) == _INT:
        out = jnp.trunc(out)
    return out.astype(dtype)


@rule(aten.logspace.default)
def _logspace(start, end, steps, base=10.0, dtype=None, **kwargs):
    return jnp.power(base, _linspace(start, end, steps, dtype=torch.float64)).astype(
        np_dtype(dtype))


# -- random ---------------------------------------------------------------------------------------


def _key(raw):
    return jax.random.wrap_key_data(raw, impl="threefry2x32")


def _float_dtype(dtype):
    return np_dtype(dtype) if dtype is not None else np.float32


@rule(aten.rand.default)
def _rand(size, dtype=None, _key=None, **kwargs):
    return jax.random.uniform(_key_of(_key), tuple(size), _float_dtype(dtype))


def _key_of(raw):
    return _key(raw)


@rule(aten.randn.default)
def _randn(size, dtype=None, _key=None, **kwargs):
    dt = _float_dtype(dtype)
    return jax.random.normal(_key_of(_key), tuple(size), np.float32 if dt != np.float64 else dt
                             ).astype(dt)


@rule(aten.randint.default)
def _randint(high, size, dtype=None, _key=None, **kwargs):
    return jax.random.randint(_key_of(_key), tuple(size), 0, high, np.int64).astype(np_dtype(dtype))


@rule(aten.randint.low)
def _randint_low(low, high, size, dtype=None, _key=None, **kwargs):
    return jax.random.randint(_key_of(_key), tuple(size), low, high, np.int64).astype(
        np_dtype(dtype))


@rule(aten.rand_like.default)
def _rand_like(x, dtype=None, _key=None, **kwargs):
    dtype = np_dtype(dtype) if dtype is not None else x.dtype
    compute = dtype if _category(dtype) == _FLOAT else np.float32
    return jax.random.uniform(_key_of(_key), x.shape, compute).astype(dtype)


@rule(aten.randn_like.default)
def _randn_like(x, dtype=None, _key=None, **kwargs):
    return jax.random.normal(_key_of(_key), x.shape, np_dtype(dtype) if dtype else x.dtype)


@rule(aten.randperm.default)
def _randperm(n, dtype=None, _key=None, **kwargs):
    return jax.random.permutation(_key_of(_key), n).astype(np_dtype(dtype))


@rule(aten.uniform.default)
def _uniform(x, low=0.0, high=1.0, _key=None, **kwargs):
    dt = x.dtype if _category(x.dtype) == _FLOAT else np.float32
    u = jax.random.uniform(_key_of(_key), x.shape, np.float32 if dt != np.float64 else dt)
    return (u * (high - low) + low).astype(x.dtype)


@rule(aten.normal_functional.default)
def _normal_functional(x, mean=0.0, std=1.0, _key=None, **kwargs):
    n = jax.random.normal(_key_of(_key), x.shape, np.float32 if x.dtype != np.float64 else x.dtype)
    return (n * std + mean).astype(x.dtype)


@rule(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor)
def _normal_tensors(mean, std=1.0, _key=None, **kwargs):
    mean, std = promote(mean, std)
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    n = jax.random.normal(_key_of(_key), shape, np.float32 if mean.dtype != np.float64
                          else mean.dtype)
    return (n * std + mean).astype(mean.dtype)


@rule(aten.bernoulli.p)
def _bernoulli_p(x, p=0.5, _key=None, **kwargs):
    u = jax.random.uniform(_key_of(_key), x.shape, np.float32)
    return (u < p).astype(x.dtype)


@rule(aten.bernoulli.default, aten.bernoulli.Tensor)
def _bernoulli(x, p=None, _key=None, **kwargs):
    probs = x if p is None else jnp.broadcast_to(p, x.shape)
    u = jax.random.uniform(_key_of(_key), x.shape, np.float32)
    return (u < probs).astype(x.dtype)


@rule(getattr(aten.random, "from"))
def _random_from(x, low, high=None, _key=None, **kwargs):
    if high is None:
        high = 2 ** 63 - 1 if x.dtype == np.int64 else int(2 ** jnp.finfo(x.dtype).nmant) if \
            _category(x.dtype) == _FLOAT else int(jnp.iinfo(x.dtype).max) + 1
    return jax.random.randint(_key_of(_key), x.shape, low, high, np.int64).astype(x.dtype)


@rule(aten.random.to)
def _random_to(x, high, _key=None, **kwargs):
    return jax.random.randint(_key_of(_key), x.shape, 0, high, np.int64).astype(x.dtype)


@rule(aten.exponential.default)
def _exponential(x, lambd=1.0, _key=None, **kwargs):
    return (jax.random.exponential(_key_of(_key), x.shape, np.float32) / lambd).astype(x.dtype)


@rule(aten.native_dropout.default)
def _native_dropout(x, p, train=True, _key=None):
    if train is False:
        return x, jnp.ones(x.shape, np.bool_)
    # ``p`` is a graph input (a traced scalar): p >= 1 keeps nothing, as u >= p never holds.
    keep = jax.random.uniform(_key_of(_key), x.shape, np.float32) >= p
    scale = jnp.where(p < 1, 1.0 / jnp.maximum(1.0 - p, 1e-30), 0.0).astype(x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep


@rule(aten.native_dropout_backward)
def _native_dropout_backward(grad, mask, scale):
    if grad.dtype == np.bool_:  # computed in float, then cast back (as ATen does)
        grad = grad.astype(np.float32)
    return jnp.where(mask, grad * jnp.asarray(scale, grad.dtype), jnp.zeros((), grad.dtype))


# -- views (as values) ---------------------------------------------------------------------------


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
    if target.itemsize == x.dtype.itemsize:
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
    if x.ndim == 0:
        return jnp.reshape(x, (1,))
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


# -- shape ops --------------------------------------------------------------------------------------


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
    return jnp.take_along_axis(x, index, axis=dim % x.ndim, mode="clip") if index.size else \
        jnp.zeros(index.shape, x.dtype)


def _scatter_indices(x, dim, index):
    dim = dim % x.ndim
    grids = jnp.meshgrid(*[jnp.arange(n) for n in index.shape], indexing="ij")
    grids[dim] = index
    return tuple(grids)


@rule(aten.scatter.src, aten.scatter.value)
def _scatter(x, dim, index, src):
    if x.ndim == 0:
        return jnp.asarray(src, x.dtype).reshape(())
    if not hasattr(src, "shape") or jnp.ndim(src) == 0:
        src = jnp.broadcast_to(jnp.asarray(src, x.dtype), index.shape)
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_scatter_indices(x, dim, index)].set(src.astype(x.dtype))


@rule(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_with_reduce(x, dim, index, src, reduce):
    if not hasattr(src, "shape") or jnp.ndim(src) == 0:
        src = jnp.broadcast_to(jnp.asarray(src, x.dtype), index.shape)
    src = src[tuple(slice(0, n) for n in index.shape)].astype(x.dtype)
    if x.ndim == 0:
        return x + src.reshape(()) if reduce == "add" else x * src.reshape(())
    idx = _scatter_indices(x, dim, index)
    if reduce == "add":
        return _scatter_sum(x, idx, src)
    return x.at[idx].min(src) if x.dtype == np.bool_ else x.at[idx].multiply(src)


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
def _scatter_add(x, dim, index, src):
    if x.ndim == 0:
        return _add(x, src.reshape(()))
    src = src[tuple(slice(0, n) for n in index.shape)]
    return _scatter_sum(x, _scatter_indices(x, dim, index), src.astype(x.dtype))


@rule(aten.scatter_reduce.two)
def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if x.dtype == np.bool_:  # sum is "or", prod is "and": reduce as integers
        return _scatter_reduce(x.astype(np.int32), dim, index, src.astype(np.int32), reduce,
                               include_self) != 0
    src = src[tuple(slice(0, n) for n in index.shape)].astype(x.dtype)
    idx = _scatter_indices(x, dim, index)
    if reduce == "sum":
        base = x if include_self else x.at[idx].set(0)
        return base.at[idx].add(src)
    if reduce == "prod":
        base = x if include_self else x.at[idx].set(1)
        return base.at[idx].multiply(src)
    if reduce == "amax":
        base = x if include_self else x.at[idx].set(_lowest(x.dtype))
        return base.at[idx].max(src)
    if reduce == "amin":
        base = x if include_self else x.at[idx].set(_highest(x.dtype))
        return base.at[idx].min(src)
    if reduce == "mean":
        ones = jnp.ones(index.shape, x.dtype)
        count = jnp.zeros(x.shape, x.dtype).at[idx].add(ones) + (1 if include_self else 0)
        total = (x if include_self else x.at[idx].set(0)).at[idx].add(src)
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


@rule(aten.index.Tensor)
def _index(x, indices):
    return x[_index_tuple(x, indices)]


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
    if x.dtype == np.bool_:
        return x.at[idx].max(values)
    return x.at[idx].add(values)


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
    out = jnp.zeros((num_weights, grad.shape[-1]), grad.dtype).at[flat_idx].add(flat_grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[flat_idx].add(1)
        out = out / jnp.maximum(counts, 1)[:, None]
    return out


# -- reductions ---------------------------------------------------------------------------------


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
    return jnp.max(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.amin)
def _amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_dims(x, dim), keepdims=keepdim)


@rule(aten.max.default)
def _max_all(x):
    return jnp.max(x)


@rule(aten.min.default)
def _min_all(x):
    return jnp.min(x)


@rule(aten.max.dim)
def _max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return jnp.max(x, axis=dim, keepdims=keepdim), _argmax(x, dim, keepdim)


@rule(aten.min.dim)
def _min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    return jnp.min(x, axis=dim, keepdims=keepdim), _argmin(x, dim, keepdim)


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


@rule(aten.var.correction)
def _var(x, dim=None, correction=None, keepdim=False):
    return jnp.var(x, axis=_dims(x, dim), ddof=_correction(correction), keepdims=keepdim)


@rule(aten.std.correction)
def _std(x, dim=None, correction=None, keepdim=False):
    return jnp.std(x, axis=_dims(x, dim), ddof=_correction(correction), keepdims=keepdim)


@rule(aten.var_mean.correction)
def _var_mean(x, dim=None, correction=None, keepdim=False):
    axis = _dims(x, dim)
    return (jnp.var(x, axis=axis, ddof=_correction(correction), keepdims=keepdim),
            jnp.mean(x, axis=axis, keepdims=keepdim))


@rule(aten.std_mean.correction)
def _std_mean(x, dim=None, correction=None, keepdim=False):
    axis = _dims(x, dim)
    return (jnp.std(x, axis=axis, ddof=_correction(correction), keepdims=keepdim),
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
        return jnp.max(a, axis=axis, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(a, axis=axis, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((a != 0).astype(x.dtype), axis=axis, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axis, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis, keepdims=keepdim))
    return jnp.sum(a ** ord, axis=axis, keepdims=keepdim) ** (1.0 / ord)


@rule(aten.cumsum)
def _cumsum(x, dim, dtype=None):
    acc = _acc_dtype(x, dtype)
    if x.ndim == 0:
        return x.astype(acc)
    return jnp.cumsum(x.astype(acc), axis=dim % x.ndim)


@rule(aten.cumprod)
def _cumprod(x, dim, dtype=None):
    acc = _acc_dtype(x, dtype)
    if x.ndim == 0:
        return x.astype(acc)
    return jnp.cumprod(x.astype(acc), axis=dim % x.ndim)


@rule(aten.logcumsumexp)
def _logcumsumexp(x, dim):
    return lax.cumlogsumexp(x, axis=dim % x.ndim) if x.ndim else x


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


@rule(aten.median.default)
def _median(x):
    flat = jnp.sort(jnp.ravel(x))  # NaNs sort last
    value = flat[(flat.size - 1) // 2]
    if _category(x.dtype) == _FLOAT:
        value = jnp.where(jnp.any(jnp.isnan(flat)), jnp.nan, value)
    return value


@rule(aten.nanmedian.default)
def _nanmedian(x):
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


@rule(aten.sort.default, aten.sort.stable)
def _sort(x, *args, stable=None, dim=-1, descending=False):
    if args:
        dim = args[0]
        descending = args[1] if len(args) > 1 else descending
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    dim = dim % x.ndim
    key = -x if descending and _category(x.dtype) != _BOOL else x
    if descending and _category(x.dtype) == _BOOL:
        key = ~x
    idx = jnp.argsort(key, axis=dim, stable=True)
    if descending and _category(x.dtype) == _FLOAT:
        # NaN sorts first when descending, last when ascending (as in PyTorch).
        idx = jnp.take_along_axis(idx, jnp.argsort(jnp.take_along_axis(
            ~jnp.isnan(x), idx, axis=dim), axis=dim, stable=True), axis=dim)
    return jnp.take_along_axis(x, idx, axis=dim), idx.astype(np.int64)


@rule(aten.topk)
def _topk(x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), np.int64)
    dim = dim % x.ndim
    moved = jnp.moveaxis(x, dim, -1)
    if largest:
        vals, idx = lax.top_k(moved, k)
    else:
        vals, idx = lax.top_k(-moved, k)
        vals = -vals
    return jnp.moveaxis(vals, -1, dim), jnp.moveaxis(idx, -1, dim).astype(np.int64)


# -- softmax and friends ----------------------------------------------------------------------------


@rule(aten._softmax)
def _softmax(x, dim, half_to_float=False):
    out = jax.nn.softmax(x.astype(np.float32) if half_to_float else x, axis=dim % max(x.ndim, 1))
    return out


@rule(aten._log_softmax)
def _log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(x.astype(np.float32) if half_to_float else x,
                              axis=dim % max(x.ndim, 1))


@rule(aten._softmax_backward_data)
def _softmax_backward_data(grad, out, dim, input_dtype):
    dim = dim % max(out.ndim, 1)
    return out * (grad - jnp.sum(grad * out, axis=dim, keepdims=True))


@rule(aten._log_softmax_backward_data)
def _log_softmax_backward_data(grad, out, dim, input_dtype):
    dim = dim % max(out.ndim, 1)
    return grad - jnp.exp(out) * jnp.sum(grad, axis=dim, keepdims=True)


# -- linear algebra ----------------------------------------------------------------------------


def _mm_precision():
    return lax.Precision.HIGHEST


def _matmul(a, b):
    a, b = promote(a, b)
    if _category(a.dtype) == _INT or a.dtype == np.bool_:
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, precision=_mm_precision())


@rule(aten.mm, aten.bmm, aten.matmul, aten.dot, aten.mv, aten.vdot)
def _mm(a, b):
    return _matmul(a, b)


def _scale(x, factor):
    """``x * factor`` for a Python (or weak 0-d) ``factor``, cast to x's dtype as ATen does."""
    if isinstance(factor, (int, float)) and factor == 1:
        return x
    return x * jnp.asarray(factor, x.dtype)


@rule(aten.addmm)
def _addmm(bias, a, b, beta=1, alpha=1):
    out = _matmul(a, b)
    out = _scale(out, alpha)
    if isinstance(beta, (int, float)) and beta == 0:
        return out  # bias is ignored, NaN included
    return out + _scale(bias.astype(out.dtype), beta)


@rule(aten.baddbmm)
def _baddbmm(bias, a, b, beta=1, alpha=1):
    return _addmm(bias, a, b, beta, alpha)


@rule(aten.addmv)
def _addmv(bias, a, v, beta=1, alpha=1):
    return _addmm(bias, a, v, beta, alpha)


@rule(aten.addbmm)
def _addbmm(bias, a, b, beta=1, alpha=1):
    out = _scale(jnp.sum(_matmul(a, b), axis=0), alpha)
    if isinstance(beta, (int, float)) and beta == 0:
        return out
    return out + _scale(bias.astype(out.dtype), beta)


@rule(aten._cdist_forward)
def _cdist_forward(x1, x2, p, compute_mode=None):
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    return _p_norm_last(diff, p)


def _p_norm_last(a, p):
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == float("inf"):
        return jnp.max(a, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a ** p, axis=-1) ** (1.0 / p)


@rule(aten._pdist_forward)
def _pdist_forward(x, p=2):
    i, j = np.triu_indices(x.shape[0], 1)
    return _p_norm_last(jnp.abs(x[i] - x[j]), p)


@rule(aten.view_as_real)
def _view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@rule(aten.complex)
def _complex(real, imag):
    return lax.complex(*jnp.broadcast_arrays(*promote(real, imag)))


@rule(aten.polar)
def _polar(absolute, angle):
    absolute, angle = jnp.broadcast_arrays(*promote(absolute, angle))
    return lax.complex(absolute * jnp.cos(angle), absolute * jnp.sin(angle))


@rule(aten.outer)
def _outer(a, b):
    return jnp.outer(*promote(a, b))


# -- neural-network ops ------------------------------------------------------------------------------


def _conv_dimension_numbers(nd):
    spatial = "DHW"[-nd:] if nd <= 3 else None
    return lax.conv_dimension_numbers((1, 1) + (1,) * nd, (1, 1) + (1,) * nd,
                                      ("NC" + spatial, "OI" + spatial, "NC" + spatial))


@rule(aten.convolution.default)
def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    dn = _conv_dimension_numbers(nd)
    if not transposed:
        out = lax.conv_general_dilated(
            x, w, window_strides=tuple(stride), padding=[(p, p) for p in padding],
            rhs_dilation=tuple(dilation), dimension_numbers=dn, feature_group_count=groups,
            precision=_mm_precision())
    else:
        # Transposed conv = gradient of conv wrt its input: dilate the input, flip the kernel.
        in_ch = w.shape[0]
        out_per_group = w.shape[1]
        k = w.reshape((groups, in_ch // groups, out_per_group) + w.shape[2:])
        k = jnp.swapaxes(k, 1, 2).reshape((groups * out_per_group, in_ch // groups) + w.shape[2:])
        k = jnp.flip(k, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (ks - 1) - p, d * (ks - 1) - p + op) for ks, p, d, op in
                zip(w.shape[2:], padding, dilation, output_padding)]
        out = lax.conv_general_dilated(
            x, k, window_strides=(1,) * nd, padding=pads, lhs_dilation=tuple(stride),
            rhs_dilation=tuple(dilation), dimension_numbers=dn, feature_group_count=groups,
            precision=_mm_precision())
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(out.dtype)
    return out


@rule(aten.convolution_backward.default)
def _convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    def f(x_, w_):
        return _convolution(x_, w_, None, stride, padding, dilation, transposed, output_padding,
                            groups)
    _, vjp = jax.vjp(f, x, w)
    gx, gw = vjp(grad)
    nd = x.ndim - 2
    gb = jnp.sum(grad, axis=(0,) + tuple(range(2, 2 + nd))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


def _bn_stats_shape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _batch_norm_train(x, weight, bias, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    xf = x.astype(np.float32) if x.dtype in (np.float16, jnp.bfloat16) else x
    mean = jnp.mean(xf, axis=axes)
    var = jnp.var(xf, axis=axes)
    rstd = lax.rsqrt(var + eps)
    shape = _bn_stats_shape(x)
    out = (xf - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(x.dtype), mean, rstd, var


def _batch_norm_eval(x, weight, bias, running_mean, running_var, eps):
    shape = _bn_stats_shape(x)
    rstd = lax.rsqrt(running_var + eps)
    out = (x - running_mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(x.dtype)


def _update_running(running, batch, momentum):
    return running * (1 - momentum) + batch.astype(running.dtype) * momentum


@rule(aten._batch_norm_with_update_functional.default)
def _bn_with_update(x, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, rstd, var = _batch_norm_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    return (out, mean, rstd, jnp.zeros((0,), np.uint8),
            _update_running(running_mean, mean, momentum),
            _update_running(running_var, unbiased, momentum))


@rule(aten._batch_norm_no_update.default)
def _bn_no_update(x, weight, bias, running_mean, running_var, momentum, eps):
    if running_mean is None:
        out, mean, rstd, _ = _batch_norm_train(x, weight, bias, eps)
        return out, mean, rstd, jnp.zeros((0,), np.uint8)
    out = _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
    return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype), jnp.zeros((0,), np.uint8)


@rule(aten._native_batch_norm_legit_functional.default)
def _bn_legit_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        out, mean, rstd, var = _batch_norm_train(x, weight, bias, eps)
        n = x.size // x.shape[1]
        unbiased = var * (n / max(n - 1, 1))
        return (out, mean, rstd, _update_running(running_mean, mean, momentum),
                _update_running(running_var, unbiased, momentum))
    out = _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
    return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype), running_mean, running_var


@rule(aten._native_batch_norm_legit_no_training.default)
def _bn_legit_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    out = _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
    return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype)


@rule(aten._native_batch_norm_legit.no_stats)
def _bn_legit_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, rstd, _ = _batch_norm_train(x, weight, bias, eps)
    return out, mean, rstd


@rule(aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
def _bn_backward(grad, x, weight, running_mean, running_var, save_mean, save_rstd, train, eps,
                 output_mask, *rest):
    shape = _bn_stats_shape(x)
    axes = (0,) + tuple(range(2, x.ndim))
    if train:
        mean, rstd = save_mean, save_rstd
    else:
        mean, rstd = running_mean, lax.rsqrt(running_var + eps)
    gf = grad.astype(np.float32) if grad.dtype in (np.float16, jnp.bfloat16) else grad
    xhat = (x - mean.reshape(shape)) * rstd.reshape(shape)
    w = weight.reshape(shape) if weight is not None else 1.0
    gw = jnp.sum(gf * xhat, axis=axes)
    gb = jnp.sum(gf, axis=axes)
    if train:
        n = x.size // x.shape[1]
        gx = (w * rstd.reshape(shape) / n) * (n * gf - gb.reshape(shape) - xhat * gw.reshape(shape))
    else:
        gx = gf * w * rstd.reshape(shape)
    return (gx.astype(x.dtype) if output_mask[0] else None,
            gw if output_mask[1] else None, gb if output_mask[2] else None)


@rule(aten.native_layer_norm.default)
def _layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(np.float32) if x.dtype in (np.float16, jnp.bfloat16) else x
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(x.dtype), mean, rstd


@rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    batch_axes = tuple(range(x.ndim - len(normalized_shape)))
    n = int(np.prod(normalized_shape))
    xhat = (x - mean) * rstd
    g = grad * weight if weight is not None else grad
    gx = (rstd / n) * (n * g - jnp.sum(g, axis=axes, keepdims=True)
                       - xhat * jnp.sum(g * xhat, axis=axes, keepdims=True))
    gw = jnp.sum(grad * xhat, axis=batch_axes) if output_mask[1] and weight is not None else None
    gb = jnp.sum(grad, axis=batch_axes) if output_mask[2] and bias is not None else None
    return (gx.astype(x.dtype) if output_mask[0] else None, gw, gb)


def _pool_pads(x_shape, kernel, stride, padding, dilation, ceil_mode):
    pads = []
    for size, k, s, p, d in zip(x_shape, kernel, stride, padding, dilation):
        eff = d * (k - 1) + 1
        out = (size + 2 * p - eff) // s + 1
        if ceil_mode:
            out = -(-(size + 2 * p - eff) // s) + 1
            if (out - 1) * s >= size + p:
                out -= 1
        hi = (out - 1) * s + eff - size - p
        pads.append((p, max(hi, 0)))
    return pads


def _norm_pool_args(nd, kernel, stride, padding, dilation=1):
    def tup(v, default):
        if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
            v = default
        if isinstance(v, int):
            return (v,) * nd
        return tuple(v) * (nd if len(v) == 1 else 1)
    kernel = tup(kernel, None)
    return kernel, tup(stride, kernel), tup(padding, 0), tup(dilation, 1)


@rule(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    nd = 2 if len(kernel_size) <= 2 and (x.ndim in (3, 4)) else 3
    kernel, stride, padding, dilation = _norm_pool_args(nd, kernel_size, stride, padding,
                                                          dilation)
    spatial = x.shape[-nd:]
    pads = _pool_pads(spatial, kernel, stride, padding, dilation, ceil_mode)
    lead = x.ndim - nd
    init = _lowest(x.dtype)
    # Flat spatial index of every input element, carried along to find the argmax.
    flat_idx = jnp.arange(int(np.prod(spatial)), dtype=np.int64).reshape(spatial)
    flat_idx = jnp.broadcast_to(flat_idx, x.shape)
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    dil = (1,) * lead + dilation
    full_pads = [(0, 0)] * lead + pads

    def reducer(a, b):
        av, ai = a
        bv, bi = b
        take_b = (bv > av) | jnp.isnan(bv) | ((bv == av) & (bi < ai))
        take_b = take_b & ~jnp.isnan(av) | (jnp.isnan(bv) & ~jnp.isnan(av))
        return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)

    vals, idx = lax.reduce_window((x, flat_idx), (jnp.asarray(init, x.dtype),
                                                   jnp.asarray(-1, np.int64)),
                                  reducer, window, strides, full_pads, window_dilation=dil)
    return vals, idx


@rule(aten.max_pool2d_with_indices_backward.default,
      aten.max_pool3d_with_indices_backward.default)
def _max_pool_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    nd = len(kernel_size) if len(kernel_size) > 1 else (2 if x.ndim in (3, 4) else 3)
    lead = x.ndim - nd
    spatial = int(np.prod(x.shape[-nd:]))
    g = grad.reshape(x.shape[:lead] + (-1,))
    i = indices.reshape(x.shape[:lead] + (-1,))
    out = jnp.zeros(x.shape[:lead] + (spatial,), grad.dtype)
    lead_idx = jnp.meshgrid(*[jnp.arange(n) for n in x.shape[:lead]], jnp.arange(g.shape[-1]),
                            indexing="ij")
    out = out.at[tuple(lead_idx[:-1]) + (i,)].add(g)
    return out.reshape(x.shape)


@rule(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    nd = len(kernel_size) if isinstance(kernel_size, (list, tuple)) and len(kernel_size) > 1 \
        else (2 if x.ndim in (3, 4) else 3)
    kernel, stride, padding, _ = _norm_pool_args(nd, kernel_size, stride, padding)
    lead = x.ndim - nd
    pads = _pool_pads(x.shape[-nd:], kernel, stride, padding, (1,) * nd, ceil_mode)
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    full_pads = [(0, 0)] * lead + pads
    # A concrete (numpy) zero: lax.reduce_window then recognises a sum, which JAX can differentiate.
    total = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, window, strides, full_pads)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:
        # Count window cells inside the input padded by `padding` (not the ceil-mode extra).
        ones = jnp.ones(x.shape[-nd:], x.dtype)
        ones = jnp.pad(ones, [(p, p) for p in padding], constant_values=1)
        extra = [(0, hi - p) for (lo, hi), p in zip(pads, padding)]
        counts = lax.reduce_window(ones, jnp.zeros((), x.dtype), lax.add, kernel, stride,
                                   [(0, max(e[1], 0)) for e in extra])
    else:
        ones = jnp.ones(x.shape[-nd:], x.dtype)
        counts = lax.reduce_window(ones, jnp.zeros((), x.dtype), lax.add, kernel, stride, pads)
    return total / counts


@rule(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    _, vjp = jax.vjp(lambda v: _avg_pool(v, kernel_size, stride, padding, ceil_mode,
                                         count_include_pad, divisor_override), x)
    return vjp(grad)[0]


def _adaptive_bounds(size, out):
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


@rule(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool(x, output_size):
    nd = len(output_size)
    out = x
    for d, o in enumerate(output_size):
        axis = x.ndim - nd + d
        size = x.shape[axis]
        if size % o == 0:
            k = size // o
            shape = out.shape[:axis] + (o, k) + out.shape[axis + 1:]
            out = jnp.mean(out.reshape(shape), axis=axis + 1)
        else:
            pieces = [jnp.mean(lax.slice_in_dim(out, a, b, 1, axis), axis=axis, keepdims=True)
                      for a, b in _adaptive_bounds(size, o)]
            out = jnp.concatenate(pieces, axis=axis)
    return out


@rule(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool_backward(grad, x):
    nd = 2 if grad.ndim == x.ndim and len(x.shape) in (3, 4) else 3
    _, vjp = jax.vjp(lambda v: _adaptive_avg_pool(v, grad.shape[-nd:]), x)
    return vjp(grad)[0]


@rule(aten.nll_loss_forward.default)
def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    if x.ndim == 1:
        x = x[None]
        target = target[None]
    picked = -jnp.take_along_axis(x, jnp.clip(target, 0, x.shape[1] - 1)[:, None], axis=1)[:, 0]
    valid = target != ignore_index
    w = jnp.ones((x.shape[1],), x.dtype) if weight is None else weight
    wt = jnp.where(valid, w[jnp.clip(target, 0, x.shape[1] - 1)], 0)
    losses = picked * wt
    total_weight = jnp.sum(wt)
    if reduction == 0:
        return losses, jnp.zeros((), x.dtype)
    if reduction == 1:
        return jnp.sum(losses) / total_weight, total_weight
    return jnp.sum(losses), total_weight


@rule(aten.nll_loss_backward.default)
def _nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    squeeze = x.ndim == 1
    if squeeze:
        x = x[None]
        target = target[None]
    n, c = x.shape
    safe = jnp.clip(target, 0, c - 1)
    w = jnp.ones((c,), x.dtype) if weight is None else weight
    wt = jnp.where(target != ignore_index, w[safe], 0)
    if reduction == 0:
        g = grad.reshape(-1) * wt
    elif reduction == 1:
        g = grad * wt / total_weight
    else:
        g = grad * wt
    out = jnp.zeros((n, c), x.dtype).at[jnp.arange(n), safe].set(-g.astype(x.dtype))
    return out[0] if squeeze else out


@rule(aten.mse_loss.default)
def _mse_loss(x, target, reduction=1):
    d = jnp.square(x - target)
    return _reduce_loss(d, reduction)


def _reduce_loss(v, reduction):
    if reduction == 1:
        return jnp.mean(v)
    if reduction == 2:
        return jnp.sum(v)
    return v


@rule(aten.mse_loss_backward.default)
def _mse_loss_backward(grad, x, target, reduction):
    g = 2 * (x - target) * grad
    if reduction == 1:
        g = g / x.size
    return g


@rule(aten.binary_cross_entropy_with_logits.default)
def _bce_logits(x, target, weight=None, pos_weight=None, reduction=1):
    log_sig = jax.nn.log_sigmoid(x)
    log_one_minus = jax.nn.log_sigmoid(-x)
    if pos_weight is not None:
        loss = -(pos_weight * target * log_sig + (1 - target) * log_one_minus)
    else:
        loss = -(target * log_sig + (1 - target) * log_one_minus)
    if weight is not None:
        loss = loss * weight
    return _reduce_loss(loss, reduction)


@rule(aten.upsample_nearest2d.default)
def _upsample_nearest2d(x, output_size, scales_h=None, scales_w=None):
    h, w = x.shape[-2:]
    oh, ow = output_size
    sh = (h / oh) if scales_h is None else 1.0 / scales_h
    sw = (w / ow) if scales_w is None else 1.0 / scales_w
    ih = np.minimum(np.floor(np.arange(oh) * sh).astype(np.int64), h - 1)
    iw = np.minimum(np.floor(np.arange(ow) * sw).astype(np.int64), w - 1)
    return x[..., ih, :][..., iw]


@rule(aten.upsample_nearest2d_backward.default)
def _upsample_nearest2d_backward(grad, output_size, input_size, scales_h=None, scales_w=None):
    x = jnp.zeros(tuple(input_size), grad.dtype)
    _, vjp = jax.vjp(lambda v: _upsample_nearest2d(v, output_size, scales_h, scales_w), x)
    return vjp(grad)[0]


# -- foreach (lists of tensors, as torch.optim's default implementations use) -------------------


def _foreach(fn, n_lists):
    def lower(*args, **kwargs):
        lists = args[:n_lists]
        rest = args[n_lists:]
        out = []
        for i, items in enumerate(zip(*lists)):
            extra = tuple(r[i] if isinstance(r, (list, tuple)) else r for r in rest)
            kw = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
            out.append(fn(*items, *extra, **kw))
        return out
    return lower


_FOREACH_UNARY = {
    "sqrt": _UNARY_FLOAT[aten.sqrt], "exp": _UNARY_FLOAT[aten.exp],
    "log": _UNARY_FLOAT[aten.log], "reciprocal": _UNARY_FLOAT[aten.reciprocal],
    "sigmoid": _UNARY_FLOAT[aten.sigmoid], "tanh": _UNARY_FLOAT[aten.tanh],
    "sin": _UNARY_FLOAT[aten.sin], "cos": _UNARY_FLOAT[aten.cos],
    "expm1": _UNARY_FLOAT[aten.expm1], "log1p": _UNARY_FLOAT[aten.log1p],
    "rsqrt": _UNARY_FLOAT[aten.rsqrt],
}
for _name, _fn in _FOREACH_UNARY.items():
    rule(getattr(aten, f"_foreach_{_name}").default)(_foreach(_unary_float(_fn), 1))
rule(aten._foreach_neg.default)(_foreach(jnp.negative, 1))
rule(aten._foreach_abs.default)(_foreach(jnp.abs, 1))
rule(aten._foreach_zero.default)(_foreach(_zero, 1))
rule(aten._foreach_sign.default)(_foreach(jnp.sign, 1))

for _name, _fn in {"add": _add, "sub": _sub, "mul": RULES[aten.mul.Tensor],
                   "div": _div, "maximum": _maximum,
                   "minimum": RULES[aten.minimum.default], "pow": _pow,
                   "clamp_min": lambda x, m: _clamp(x, min=m),
                   "clamp_max": lambda x, m: _clamp(x, max=m)}.items():
    packet = getattr(aten, f"_foreach_{_name}")
    for _ov in packet.overloads():
        if _ov.endswith("out"):
            continue
        n_lists = 2 if _ov == "List" else 1
        rule(getattr(packet, _ov))(_foreach(_fn, n_lists))

rule(aten._foreach_lerp.List)(_foreach(_lerp, 3))
rule(aten._foreach_lerp.Scalar)(_foreach(_lerp, 2))
rule(aten._foreach_lerp.ScalarList)(_foreach(_lerp, 2))
for _ov in ("Scalar", "ScalarList", "Tensor"):
    rule(getattr(aten._foreach_addcmul, _ov))(_foreach(_addcmul, 3))
    rule(getattr(aten._foreach_addcdiv, _ov))(_foreach(_addcdiv, 3))
rule(aten._foreach_copy.default)(_foreach(_copy, 2))


@rule(aten._foreach_norm.Scalar)
def _foreach_norm(tensors, ord=2, dtype=None):
    return [_vector_norm(t, ord, None, False, dtype) for t in tensors]
