"""Fused attention (``_scaled_dot_product_fused_attention_overrideable`` and its backward) as a few
einsums, so XLA sees attention the way a hand-written JAX model expresses it (see
xshard.core.attention for how the fused op is chosen)."""

from __future__ import annotations

import math

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.linalg import _mm_precision
from xshard.core.lowering.table import HALF_FLOATS, rule

jax = runtime.jax_module()
jnp = jax.numpy

aten = torch.ops.aten


def _scores(q, k, attn_bias, is_causal, scale):
    """The scaled, masked scores: float32 for 16-bit floats, as ATen's CPU kernel and
    ``jax.nn.dot_product_attention`` keep them (rounded to bfloat16, a score of 30 was off by up
    to 0.06, its probability by 6%)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    wide = {"preferred_element_type": np.float32} if q.dtype in HALF_FLOATS else {}
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision=_mm_precision(), **wide)
    s = s * jnp.asarray(scale, s.dtype)
    lq, lk = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = np.tril(np.ones((lq, lk), dtype=bool))
        s = jnp.where(keep, s, -jnp.inf)
    if attn_bias is not None:
        if attn_bias.dtype == np.bool_:
            s = jnp.where(attn_bias, s, -jnp.inf)
        else:
            s = s + attn_bias.astype(s.dtype)
    return s, scale


def _probs(s, lse):
    # Rows with every key masked give zeros, as PyTorch's safe softmax does.
    return jnp.where(jnp.isneginf(lse)[..., None], 0.0, jnp.exp(s - lse[..., None]))


@rule(aten._scaled_dot_product_fused_attention_overrideable.default)
def _forward(q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
             scale=None, _key=None):
    s, _ = _scores(q, k, attn_bias, is_causal, scale)
    sf = s.astype(np.float32) if s.dtype != np.float64 else s
    # As ATen's CPU kernel: exp(s - max) in the inputs' dtype times v, summed in float32, then
    # divided by the sum of exp(s - max) and rounded once. Rows with every key masked give zeros
    # (and a logsumexp of -inf).
    top, weights, total = _softmax_parts(sf)
    lse = (top + jnp.log(total))[..., 0]
    out = jnp.einsum("...qk,...kd->...qd", weights.astype(q.dtype), v, precision=_mm_precision(),
                     preferred_element_type=sf.dtype)
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1), 0).astype(q.dtype)
    zero = jnp.zeros((), np.int64)
    return (out, lse.reshape(_lse_shape(q)), None, None, q.shape[-2], k.shape[-2], zero, zero,
            None)


def _softmax_parts(s):
    """Each row's max (0 for a row with every key masked), exp(s - max) and its sum."""
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isneginf(top), jnp.zeros((), top.dtype), top)
    weights = jnp.exp(s - top)
    return top, weights, jnp.sum(weights, axis=-1, keepdims=True)


def _lse_shape(q) -> tuple:
    """The logsumexp's shape as PyTorch's meta kernel gives it: (batch..., heads, L), at least
    three dimensions (a 3-D query's gets a leading 1)."""
    lead = q.shape[:-1]
    return (1,) * max(0, 3 - len(lead)) + tuple(lead)


@rule(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _backward(grad, q, k, v, attn_bias, grad_input_mask, out, lse, cum_q, cum_k, max_q, max_k,
              dropout_p, is_causal, seed, offset, scale=None):
    s, scale = _scores(q, k, attn_bias, is_causal, scale)
    if s.dtype == np.float64:
        # The saved logsumexp is float32 (the meta kernel's dtype), 1e-7 off for float64 scores:
        # the probabilities are recomputed from the scores instead (eager's gradients to 1e-16).
        top, weights, total = _softmax_parts(s)
        p = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1), 0.0)
    else:
        p = _probs(s.astype(lse.dtype), lse.reshape(q.shape[:-1]))
    g = grad.astype(p.dtype)
    prec = _mm_precision()
    dv = jnp.einsum("...qk,...qd->...kd", p, g, precision=prec)
    dp = jnp.einsum("...qd,...kd->...qk", g, v.astype(p.dtype), precision=prec)
    delta = jnp.sum(g * out.astype(p.dtype), axis=-1, keepdims=True)
    ds = p * (dp - delta)
    dq = jnp.einsum("...qk,...kd->...qd", ds, k.astype(p.dtype), precision=prec) * scale
    dk = jnp.einsum("...qk,...qd->...kd", ds, q.astype(p.dtype), precision=prec) * scale
    dbias = None
    if attn_bias is not None and attn_bias.dtype != np.bool_:
        dbias = ds
        while dbias.ndim > attn_bias.ndim:
            dbias = dbias.sum(0)
        for axis, n in enumerate(attn_bias.shape):
            if n == 1 and dbias.shape[axis] != 1:
                dbias = dbias.sum(axis, keepdims=True)
    if dbias is None:  # not asked for: zeros of the shape PyTorch's meta kernel announces
        dbias = jnp.zeros(q.shape if attn_bias is None else attn_bias.shape, q.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias)
