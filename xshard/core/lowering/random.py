"""Random ops: each takes ``_key``, threefry key data for this op (see xshard.core.rng)."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.promotion import _FLOAT, _category, promote
from xshard.core.lowering.table import np_dtype, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


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
    # ATen's grad * mask * scale: promoted with the Python float (an integer gradient gives
    # float32), a dropped element times a negative scale is -0.0.
    grad = promote(grad, scale)[0]
    return grad * mask.astype(grad.dtype) * jnp.asarray(scale, grad.dtype)


@rule(aten.multinomial.default)
def _multinomial(probs, num_samples, replacement=False, _key=None, **kwargs):
    """``num_samples`` category indices per row of ``probs`` (weights, not necessarily summing to
    one), drawn with replacement (a categorical draw per sample), or without (the Gumbel top-k
    trick: the ``num_samples`` largest ``log p + Gumbel noise`` are a draw without replacement).
    A category of weight 0 is drawn only once no other is left (without replacement), where
    eager raises, as it does for a negative, infinite or NaN weight: a device cannot check them
    without reading the weights back (see the README's Known limits)."""
    dt = probs.dtype if probs.dtype == np.float64 else np.float32
    logits = jnp.log(probs.astype(dt))
    key = _key_of(_key)
    if replacement:
        batch = logits.shape[:-1]
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples, *batch))
        out = jnp.moveaxis(draws, 0, -1)
    else:
        noisy = logits + jax.random.gumbel(key, logits.shape, dt)
        out = lax.top_k(noisy, num_samples)[1]
    return out.astype(np.int64)
