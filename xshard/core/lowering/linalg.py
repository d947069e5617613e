"""Linear algebra: matmuls (at HIGHEST precision, as PyTorch's float32 on CPU), decompositions."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.promotion import _INT, _category, promote, result_dtype
from xshard.core.lowering.table import HALF_FLOATS, astype, keep_nan, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
import jax.scipy.linalg  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


def _mm_precision():
    return lax.Precision.HIGHEST


def _matmul(a, b, wide: bool = False):
    """``a @ b``. ``wide``: a 16-bit float product is kept in float32 (XLA accumulates it so), for
    a caller that adds to it and rounds once (see ``_round_once``)."""
    a, b = promote(a, b)
    if _category(a.dtype) == _INT or a.dtype == np.bool_:
        return jnp.matmul(a, b)
    if wide and a.dtype in HALF_FLOATS:
        return jnp.matmul(a, b, precision=_mm_precision(), preferred_element_type=np.float32)
    return jnp.matmul(a, b, precision=_mm_precision())


def _round_once(fn):
    """An add-matmul op (``beta * bias + alpha * a @ b``) whose 16-bit float product, scaling and
    sum stay in float32 and are rounded once, as ATen's CPU kernels (and cuBLAS's epilogues) do:
    rounding the product first, then the sum, differed from eager in a quarter of the elements of
    a bfloat16 ``nn.Linear`` with bias."""
    def lower(bias, a, b, beta=1, alpha=1):
        dtype = result_dtype(a, b)
        out = fn(bias, a, b, beta, alpha)
        return out.astype(dtype) if out.dtype != dtype else out
    return lower


# [Note: 16-bit products rounded once]
# ATen's CPU kernels (and cuBLAS) sum a 16-bit float product in float32 and round it once. XLA
# does too on one device, but when the contracted dim is sharded the SPMD partitioner sums each
# device's partial product in the dot's dtype: rounded to bfloat16 on each device, then summed in
# bfloat16 (a bfloat16 ``a @ a.T`` over an 8-way sharded inner dim differed from eager in 7 of 16
# elements; torch.optim.Muon's Newton-Schulz update of an FSDP-sharded momentum by 4%). The
# product is therefore kept in float32 and rounded after the sum: a sharded contraction then
# all-reduces in float32 (twice the bytes of a bfloat16 one, as FSDP's ``reduce_dtype=float32``
# already does), and an unsharded one is unchanged (XLA fuses the rounding into the dot).
@rule(aten.mm, aten.bmm, aten.matmul, aten.dot, aten.mv)
def _mm(a, b):
    dtype = result_dtype(a, b)
    out = _matmul(a, b, wide=True)
    return out.astype(dtype) if out.dtype != dtype else out


@rule(aten.vdot)
def _vdot(a, b):
    return _mm(jnp.conj(a), b)


def _scale(x, factor):
    """``x * factor`` for a Python (or weak 0-d) ``factor``, cast to x's dtype as ATen does."""
    if isinstance(factor, (int, float)) and factor == 1:
        return x
    return x * astype(jnp.asarray(factor), x.dtype)


def _zero_where_0(x, factor):
    """``x * factor``, and 0 where ``factor`` is 0 (NaN and inf in ``x`` included), as the BLAS
    calls behind PyTorch's add-matmul ops do. ``factor`` may be a traced scalar input."""
    if isinstance(factor, (int, float)):
        return jnp.zeros_like(x) if factor == 0 else _scale(x, factor)
    return jnp.where(factor == 0, jnp.zeros((), x.dtype), _scale(x, factor))


def _plus_bias(out, bias, beta):
    """``out + beta * bias``; where ``beta`` is 0, ``bias`` is ignored (NaN and inf included)."""
    if isinstance(beta, (int, float)) and beta == 0:
        return out
    return out + _zero_where_0(bias.astype(out.dtype), beta)


@rule(aten.addmm, aten.addmv)
@_round_once
def _addmm(bias, a, b, beta=1, alpha=1):
    return _plus_bias(_zero_where_0(_matmul(a, b, wide=True), alpha), bias, beta)


@rule(aten.baddbmm)
@_round_once
def _baddbmm(bias, a, b, beta=1, alpha=1):
    # Unlike addmm, addmv and addbmm, ATen's baddbmm keeps NaN of the product when alpha is 0.
    return _plus_bias(_scale(_matmul(a, b, wide=True), alpha), bias, beta)


@rule(aten.addbmm)
def _addbmm(bias, a, b, beta=1, alpha=1):
    if result_dtype(a, b) in HALF_FLOATS and a.shape[0] > 0:
        # ATen's CPU kernel adds one batch at a time, an addmm each, rounded each time.
        def add_one(total, pair):
            return _addmm(total, pair[0], pair[1], 1, alpha), None

        first = _addmm(bias, a[0], b[0], beta, alpha)
        return lax.scan(add_one, first, (a[1:], b[1:]))[0]
    return _plus_bias(_zero_where_0(jnp.sum(_matmul(a, b), axis=0), alpha), bias, beta)


@rule(aten._cdist_forward)
def _cdist_forward(x1, x2, p, compute_mode=None):
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == float("inf"):
        # ATen's CPU kernel reduces with a max that passes over NaN, from 0 (its pdist keeps the
        # NaN): a row holding a NaN gets the max of its other differences.
        return jnp.max(jnp.where(jnp.isnan(diff), 0, diff), axis=-1, initial=0)
    return _p_norm_last(diff, p)


def _p_norm_last(a, p):
    if p == 0:  # the count of differences not 0; NaN where one is NaN, as in ATen
        return jnp.sum(jnp.where(jnp.isnan(a), a, (a != 0).astype(a.dtype)), axis=-1)
    if p == float("inf"):
        return keep_nan(jnp.max(a, axis=-1, initial=0), a, -1)
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


@rule(aten.view_as_complex)
def _view_as_complex(x):
    return lax.complex(x[..., 0], x[..., 1])


@rule(aten._conj)
def _conj(x):
    return jnp.conj(x)


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


@rule(aten.linalg_matrix_exp)
def _matrix_exp(a):
    """``torch.linalg.matrix_exp`` (its backward too: autograd takes the exponential of a block
    matrix). JAX's Pade approximant with scaling and squaring; PyTorch sums a Taylor polynomial
    chosen by the norm; both are accurate to the dtype's rounding. Products at full precision."""
    with jax.default_matmul_precision("highest"):
        return jax.scipy.linalg.expm(a)
