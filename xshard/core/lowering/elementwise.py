"""Elementwise ops: unary, binary, comparisons, clamps, where, casts and copies."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.promotion import (
    _BOOL, _COMPLEX, _FLOAT, _INT, _category, _compute, _float_like, promote, promote_float,
    result_dtype)
from xshard.core.lowering.table import HALF_FLOATS, astype, in_float32, np_dtype, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


def _unary_float(fn):
    fn = in_float32(fn)

    def lower(x, *args, **kwargs):
        return fn(_float_like(x))
    return lower


def _erfcx(x):
    """exp(x**2) * erfc(x); past ``switch`` its asymptotic series in 1/x**2 (jax's float32 erfcx
    switches at 9.42, where erfc has already underflowed: 0 on (9.19, 9.42), ATen 0.06)."""
    wide = x.dtype == np.float64
    v = x if wide else x.astype(np.float32)
    switch, n_terms = (20.0, 9) if wide else (8.0, 6)
    large = v > switch
    safe = jnp.where(large, jnp.ones((), v.dtype), v)
    direct = jnp.exp(safe * safe) * jax.scipy.special.erfc(safe)
    # erfcx(x) ~ 1 / (sqrt(pi) x) * sum_k (-1)^k (2k - 1)!! / (2 x^2)^k
    t = 1 / (2 * v * v)
    series, term = jnp.ones_like(v), jnp.ones_like(v)
    for k in range(1, n_terms):
        term = term * -(2 * k - 1) * t
        series = series + term
    out = jnp.where(large, series / (v * np.sqrt(np.pi)), direct)
    return out.astype(x.dtype)


def _log_ndtr(x):
    """log of the normal CDF, as ATen computes it: ``log1p(-erfc(x / sqrt 2) / 2)`` from -1 up,
    ``log(erfcx(-t) / 2) - t**2`` below. jax's takes ``log(ndtr(x))`` for large x, where ndtr
    rounds to 1: at 5, float32's was 4% off (-2.98e-7 for -2.87e-7), float64's 7% at 8."""
    t = x * np.asarray(np.sqrt(0.5), x.dtype)
    low = jnp.log(_erfcx(-t) / 2) - t * t
    return jnp.where(x < -1, low, jnp.log1p(-jax.scipy.special.erfc(t) / 2))


_UNARY_FLOAT = {
    aten.exp: jnp.exp, aten.exp2: jnp.exp2, aten.expm1: jnp.expm1, aten.log: jnp.log,
    aten.log2: jnp.log2, aten.log10: jnp.log10, aten.log1p: jnp.log1p, aten.sqrt: jnp.sqrt,
    aten.rsqrt: lax.rsqrt, aten.sin: jnp.sin, aten.cos: jnp.cos, aten.tan: jnp.tan,
    aten.asin: jnp.arcsin, aten.acos: jnp.arccos, aten.atan: jnp.arctan, aten.sinh: jnp.sinh,
    aten.cosh: jnp.cosh, aten.tanh: jnp.tanh, aten.asinh: jnp.arcsinh, aten.acosh: jnp.arccosh,
    aten.atanh: jnp.arctanh, aten.sigmoid: jax.nn.sigmoid, aten.erf: jax.scipy.special.erf,
    aten.erfc: jax.scipy.special.erfc, aten.erfinv: jax.scipy.special.erfinv,
    # lgamma(1) = lgamma(2) = 0 exactly, as ATen (XLA's approximation: 4.8e-7 at 1)
    aten.lgamma: lambda x: jnp.where((x == 1) | (x == 2), jnp.zeros((), x.dtype),
                                     jax.scipy.special.gammaln(x)),
    # at 0: -inf, +inf at -0.0 (ATen's copysign(inf, -x))
    aten.digamma: lambda x: jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype),
                                      jax.scipy.special.digamma(x)),
    aten.i0: jax.scipy.special.i0, aten.special_i0e: jax.scipy.special.i0e,
    aten.special_i1: jax.scipy.special.i1, aten.special_i1e: jax.scipy.special.i1e,
    aten.reciprocal: jnp.reciprocal, aten.deg2rad: jnp.deg2rad, aten.rad2deg: jnp.rad2deg,
    aten.sinc: jnp.sinc,
    aten.special_ndtri: jax.scipy.special.ndtri, aten.special_ndtr: jax.scipy.special.ndtr,
    aten.special_log_ndtr: _log_ndtr, aten.special_erfcx: _erfcx,
    aten.special_entr: jax.scipy.special.entr,
}
for _op, _fn in _UNARY_FLOAT.items():
    rule(_op)(_unary_float(_fn))

_UNARY_SAME = {
    aten.neg: jnp.negative, aten.abs: jnp.abs, aten.floor: jnp.floor, aten.ceil: jnp.ceil,
    aten.trunc: jnp.trunc, aten.bitwise_not: lambda x: ~x,
    # NaN and -0.0: +0.0, as ATen's (0 < x) - (x < 0)
    aten.sign: lambda x: jnp.where(jnp.isnan(x) | (x == 0), jnp.zeros((), x.dtype), jnp.sign(x)),
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
@in_float32  # a bfloat16 x * 10 rounded before the rounding: 2.546875 gave 2.59375, ATen 2.5
def _round_decimals(x, decimals=0):
    if decimals >= 0:  # as ATen: multiply by 10**d, or divide by 10**-d, never by 0.1
        scale = 10.0 ** decimals
        return jnp.round(x * scale) / scale
    scale = 10.0 ** -decimals
    return jnp.round(x / scale) * scale


@rule(aten.frac)
def _frac(x):
    return x - jnp.trunc(x)


@rule(aten.sgn)
def _sgn(x):
    return x if x.dtype == np.bool_ else _UNARY_SAME[aten.sign](x)


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
@in_float32
def _gelu(x, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@rule(aten.gelu_backward)
@in_float32
def _gelu_backward(grad, x, approximate="none"):
    _, vjp = jax.vjp(lambda v: jax.nn.gelu(v, approximate=approximate == "tanh"), x)
    return vjp(grad)[0]


@rule(aten.silu)
@in_float32
def _silu(x):
    return x * jax.nn.sigmoid(x)


@rule(aten.silu_backward)
@in_float32
def _silu_backward(grad, x):
    s = jax.nn.sigmoid(x)
    return grad * s * (1 + x * (1 - s))


@rule(aten.mish)
@in_float32
def _mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@rule(aten.sigmoid_backward)
@in_float32
def _sigmoid_backward(grad, out):
    return grad * out * (1 - out)


@rule(aten.tanh_backward)
@in_float32
def _tanh_backward(grad, out):
    return grad * (1 - out * out)


@rule(aten.softplus)
@in_float32
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
@in_float32
def _leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@rule(aten.leaky_relu_backward)
@in_float32
def _leaky_relu_backward(grad, x, negative_slope, self_is_result):
    return jnp.where(x > 0, grad, grad * negative_slope)


@rule(aten.elu)
@in_float32
def _elu(x, alpha=1, scale=1, input_scale=1):
    return jnp.where(x > 0, x * scale, (jnp.expm1(x * input_scale)) * alpha * scale)


@rule(aten.hardsigmoid)
@in_float32
def _hardsigmoid(x):
    return jnp.clip(x / 6 + 0.5, 0, 1)


@rule(aten.hardswish)
@in_float32
def _hardswish(x):
    return x * jnp.clip(x / 6 + 0.5, 0, 1)


@rule(aten.threshold)
def _threshold(x, threshold, value):
    # The threshold in x's dtype first, as ATen (an integer x: 1.9 -> 1, -1e-6 -> 0).
    return jnp.where(x <= jnp.asarray(threshold).astype(x.dtype), jnp.asarray(value, x.dtype), x)


@rule(aten.threshold_backward)
def _threshold_backward(grad, x, threshold):
    return jnp.where(x <= jnp.asarray(threshold).astype(x.dtype), jnp.zeros((), grad.dtype), grad)


@rule(aten.igamma, torch.ops.prims.igamma.default)
def _igamma(a, x):
    return _incomplete_gamma(a, x, jax.scipy.special.gammainc, lower=True)


@rule(aten.igammac, torch.ops.prims.igammac.default)
def _igammac(a, x):
    return _incomplete_gamma(a, x, jax.scipy.special.gammaincc, lower=False)


def _incomplete_gamma(a, x, fn, lower: bool):
    """ATen's regularised incomplete gamma: its special cases first, in its order (NaN where a or
    x is negative; a = 0; x = 0, even for a NaN a; a = inf; x = inf), then jax's ``fn``."""
    a, x = promote_float(a, x)
    full, empty = (1.0, 0.0) if lower else (0.0, 1.0)
    out = fn(a, x)
    out = jnp.where(jnp.isinf(x), full, out)
    out = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), jnp.nan, empty), out)
    out = jnp.where(x == 0, empty, out)
    out = jnp.where(a == 0, jnp.where(x > 0, full, jnp.nan), out)
    return jnp.where((x < 0) | (a < 0), jnp.nan, out).astype(a.dtype)


@rule(aten.special_modified_bessel_i0)
def _bessel_i0(x):
    return jax.scipy.special.i0(_float_like(x))


@rule(aten.special_modified_bessel_i1)
def _bessel_i1(x):
    return jax.scipy.special.i1(_float_like(x))


@rule(torch.ops.prims.spherical_bessel_j0.default)
def _spherical_bessel_j0(x):
    x = _float_like(x)
    safe = jnp.where((x == 0) | jnp.isinf(x), jnp.ones((), x.dtype), x)
    out = jnp.where(x == 0, jnp.ones((), x.dtype), jnp.sin(safe) / safe)
    return jnp.where(jnp.isinf(x), jnp.zeros((), x.dtype), out)  # sin(x) / x -> 0


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


def _binary(fn, float_only=False, half_in_float32=True):
    """``fn`` over promoted operands; ``float_only``: integers computed in float (see
    ``promote_float``), 16-bit floats in float32 unless ``half_in_float32`` is False."""
    if float_only and half_in_float32:  # composites (hypot, logaddexp): rounded once
        fn = in_float32(fn)
    convert = promote_float if float_only else promote

    def lower(a, b, *rest, **kwargs):
        return fn(*convert(a, b))
    return lower


_BINARY = {
    aten.maximum: jnp.maximum, aten.minimum: jnp.minimum,
    aten.fmax: jnp.fmax, aten.fmin: jnp.fmin, aten.eq: jnp.equal, aten.ne: jnp.not_equal,
    aten.lt: jnp.less, aten.le: jnp.less_equal, aten.gt: jnp.greater, aten.ge: jnp.greater_equal,
    aten.logical_and: jnp.logical_and, aten.logical_or: jnp.logical_or,
    aten.logical_xor: jnp.logical_xor, aten.bitwise_and: jnp.bitwise_and,
    aten.bitwise_or: jnp.bitwise_or, aten.bitwise_xor: jnp.bitwise_xor,
    aten.bitwise_left_shift: jnp.left_shift, aten.bitwise_right_shift: jnp.right_shift,
    aten.__lshift__: jnp.left_shift, aten.__rshift__: jnp.right_shift,
    # PyTorch: x == 0 ? y : x > 0 (so NaN gives 0; jnp.heaviside gives NaN).
    aten.heaviside: lambda x, y: jnp.where(x == 0, y, (x > 0).astype(x.dtype)),
}
for _op, _fn in _BINARY.items():
    rule(_op)(_binary(_fn))

for _op, _fn in {aten.atan2: jnp.arctan2, aten.hypot: jnp.hypot, aten.copysign: jnp.copysign,
                 aten.logaddexp: jnp.logaddexp, aten.logaddexp2: jnp.logaddexp2}.items():
    rule(_op)(_binary(_fn, float_only=True))
# Not in float32: nextafter steps in its own dtype's spacing, and ATen's xlogy rounds log(y) to a
# 16-bit x's dtype before the product.
for _op, _fn in {aten.nextafter: jnp.nextafter, aten.xlogy: jax.scipy.special.xlogy,
                 aten.special_xlog1py: jax.scipy.special.xlog1py}.items():
    rule(_op)(_binary(_fn, float_only=True, half_in_float32=False))


@rule(aten.add)
def _add(a, b, alpha=1):
    a, b, alpha, done = _additive(a, b, alpha)
    if alpha is not None:
        b = b * alpha
    if a.dtype == np.bool_:
        return a | b
    return done(a + b)


@rule(aten.sub)
def _sub(a, b, alpha=1):
    a, b, alpha, done = _additive(a, b, alpha)
    return done(a - (b if alpha is None else b * alpha))


def _additive(a, b, alpha):
    """Operands of ``a + alpha * b`` as ATen's add kernel takes them: a Python number and ``alpha``
    rounded to the result dtype (unlike mul's), then 16-bit floats computed in float32 and
    rounded once (``done``). ``alpha`` is None when it is 1."""
    a, b = promote(a, b)
    if isinstance(alpha, (int, float)) and alpha == 1:
        alpha = None
    elif alpha is not None:
        alpha = astype(jnp.asarray(alpha), b.dtype)
    if a.dtype in HALF_FLOATS:
        dtype = a.dtype
        a, b = a.astype(np.float32), b.astype(np.float32)
        alpha = None if alpha is None else alpha.astype(np.float32)
        return a, b, alpha, lambda r: r.astype(dtype)
    return a, b, alpha, _same


@rule(aten.mul)
def _mul(a, b):
    (a, b), done = _in_opmath(a, b)
    return done(a * b) if a.dtype != np.bool_ else a & b


@rule(aten.rsub)
def _rsub(a, b, alpha=1):
    return _sub(b, a, alpha)


@rule(aten.div)
def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        if _category(result_dtype(a, b)) in (_BOOL, _INT):
            a, b = promote_float(a, b)
            return a / b
        (a, b), done = _in_opmath(a, b)
        return done(a / b)
    if rounding_mode == "trunc":
        (a, b), done = _in_opmath(a, b)
        if _category(a.dtype) == _INT:
            a, b = jnp.broadcast_arrays(a, b)
            return lax.div(a, b)
        return done(jnp.trunc(a / b))
    return _floor_divide(a, b)


@rule(aten.floor_divide)
def _floor_divide(a, b):
    (a, b), done = _in_opmath(a, b)
    if _category(a.dtype) != _FLOAT:
        return jnp.floor_divide(a, b)
    return done(_floor_of_quotient(a, b))


def _floor_of_quotient(a, b):
    # ATen's (and Python's) floor division, from fmod: 0.5 // -inf is -1, 5 // 0.1 is 49 (not
    # floor(a / b): -0 and 50), and a zero quotient takes the sign of a / b.
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    floor = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floor)
    return jnp.where(b == 0, a / b, floor)


@rule(aten.remainder)
def _remainder(a, b):
    a, b = promote(a, b)
    if _category(a.dtype) != _FLOAT:
        return jnp.remainder(a, b)
    mod = jnp.fmod(a, b)  # ATen's: a zero remainder keeps fmod's sign, not the divisor's
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@rule(aten.fmod)
def _fmod(a, b):
    a, b = promote(a, b)
    return jnp.fmod(a, b)


@rule(aten.pow)
def _pow(a, b):
    if isinstance(b, (int, float)) and not isinstance(b, bool) and hasattr(a, "dtype"):
        dtype = result_dtype(a, b)
        if float(b).is_integer() and abs(b) <= 4 and (b >= 0 or _category(a.dtype) >= _FLOAT):
            return lax.integer_pow(_compute(a, dtype), int(b))
        if b in (0.5, -0.5) and dtype != np.float16:
            # ATen's CPU kernel takes sqrt and rsqrt here (not for float16): NaN at -inf where
            # pow gives inf and 0, and -0.0 kept.
            x = _compute(a, dtype)
            return jnp.sqrt(x) if b > 0 else lax.rsqrt(x)
    a, b = promote(a, b)
    if _category(a.dtype) == _INT:
        return _int_pow(a, b)
    return jnp.power(a, b)


def _int_pow(a, b):
    """Integer powers: a negative exponent gives 0 unless the base is 1 or -1 (as in ATen); an
    overflowing one wraps as ATen's does, by squaring over every bit of the exponent (jnp.power
    looks at its 6 lowest bits: 5 ** 300 in int16 gave 4561, ATen 19921)."""
    a, b = jnp.broadcast_arrays(a, b)
    exponent, base = jnp.maximum(b, 0), a
    positive = jnp.ones_like(a)
    for _ in range(jnp.iinfo(a.dtype).bits):
        positive = jnp.where((exponent & 1) == 1, positive * base, positive)
        base, exponent = base * base, exponent >> 1
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


def _in_opmath(*xs):
    """``xs`` promoted together, in float32 where that is a 16-bit float, and the function that
    rounds a result back. ATen computes 16-bit floats in float ("opmath") and rounds once, with
    Python numbers unrounded: ``x * 0.7`` multiplies by 0.7, not by bfloat16's 0.69921875, and a
    fused lerp or addcmul rounds once (rounding each step differs where terms cancel)."""
    dtype = result_dtype(*xs)
    if dtype in HALF_FLOATS:
        return tuple(astype(jnp.asarray(x), np.float32) for x in xs), \
            lambda r: r.astype(dtype)
    return promote(*xs), _same


def _same(r):
    return r


@rule(aten.lerp)
def _lerp(start, end, weight):
    (start, end, weight), done = _in_opmath(start, end, weight)
    return done(jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start),
                          end - (end - start) * (1 - weight)))


@rule(aten.addcmul)
def _addcmul(x, t1, t2, value=1):
    # ``value`` takes no part in type promotion: in the computing dtype (an integer x truncates it)
    (x, t1, t2), done = _in_opmath(x, t1, t2)
    return done(x + astype(jnp.asarray(value), x.dtype) * t1 * t2)


@rule(aten.addcdiv)
def _addcdiv(x, t1, t2, value=1):
    (x, t1, t2), done = _in_opmath(x, t1, t2)
    return done(x + astype(jnp.asarray(value), x.dtype) * (t1 / t2))


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
    return astype(x, target)
