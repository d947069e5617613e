"""Neural-network ops: convolution, pooling, normalisation, losses, embedding, interpolation."""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.lowering.linalg import _mm_precision
from xshard.core.lowering.shape import _lowest
from xshard.core.lowering.table import HALF_FLOATS, astype, combine, in_float32, rule

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

aten = torch.ops.aten


def _conv_dimension_numbers(nd):
    spatial = "DHW"[-nd:] if nd <= 3 else None
    return lax.conv_dimension_numbers((1, 1) + (1,) * nd, (1, 1) + (1,) * nd,
                                      ("NC" + spatial, "OI" + spatial, "NC" + spatial))


@rule(aten.convolution.default)
def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups,
                 round_once: bool = True):
    nd = x.ndim - 2
    dn = _conv_dimension_numbers(nd)
    # One value stands for every spatial dim, as in ATen (``padding='valid'`` passes ``[0]``).
    stride, padding, dilation, output_padding = (
        tuple(v) * nd if len(v) == 1 else tuple(v)
        for v in (stride, padding, dilation, output_padding))
    # A 16-bit float convolution is summed (with its bias) in float32 and rounded once, as ATen's
    # CPU kernels do (rounding the convolution first differed in a quarter of the elements of a
    # bfloat16 conv2d; see [Note: 16-bit products rounded once] for a sharded contraction).
    wide = {"preferred_element_type": np.float32} if (
        round_once and x.dtype in HALF_FLOATS) else {}
    if not transposed:
        out = lax.conv_general_dilated(
            x, w, window_strides=tuple(stride), padding=[(p, p) for p in padding],
            rhs_dilation=tuple(dilation), dimension_numbers=dn, feature_group_count=groups,
            precision=_mm_precision(), **wide)
    else:
        # Transposed conv = gradient of conv wrt its input: dilate the input, flip the kernel.
        in_ch = w.shape[0]
        out_per_group = w.shape[1]
        k = w.reshape((groups, in_ch // groups, out_per_group) + w.shape[2:])
        k = jnp.swapaxes(k, 1, 2).reshape((groups * out_per_group, in_ch // groups) + w.shape[2:])
        k = jnp.flip(k, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (ks - 1) - p, d * (ks - 1) - p + op) for ks, p, d, op in
                zip(w.shape[2:], padding, dilation, output_padding)]
        lhs_dilation = tuple(stride)
        if max(stride) > 1 and max(dilation) > 1:
            # XLA's SPMD partitioner (jaxlib 0.10.2) gets a convolution dilating both its input
            # and its kernel wrong over a sharded spatial dim, or fails to verify it (plain JAX
            # too): the input is dilated by a pad instead.
            x = lax.pad(x, jnp.zeros((), x.dtype),
                        [(0, 0, 0)] * 2 + [(0, 0, s - 1) for s in lhs_dilation])
            lhs_dilation = (1,) * nd
        # A negative pad (``padding`` beyond the kernel's reach) crops the input, which made
        # the partitioner abort the process over a sharded spatial dim: pad by 0 there and crop
        # the result (the windows' stride is 1, so each output moves by the pad's difference).
        crop = [(max(-lo, 0), max(-hi, 0)) for lo, hi in pads]
        out = lax.conv_general_dilated(
            x, k, window_strides=(1,) * nd, padding=[(max(lo, 0), max(hi, 0)) for lo, hi in pads],
            lhs_dilation=lhs_dilation, rhs_dilation=tuple(dilation), dimension_numbers=dn,
            feature_group_count=groups, precision=_mm_precision(), **wide)
        out = out[(slice(None),) * 2 + tuple(slice(a, n - b) for (a, b), n in
                                             zip(crop, out.shape[2:]))]
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd).astype(out.dtype)
    return out.astype(x.dtype) if wide else out


@rule(aten.convolution_backward.default)
def _convolution_backward(grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    # Differentiated in the inputs' dtype: through a float32 product JAX's transposes would
    # convert both operands to float32 (16-bit tensor cores unused). So a 16-bit weight gradient
    # over a sharded batch sums the devices' parts in 16 bits (README, Known limits).
    def f(x_, w_):
        return _convolution(x_, w_, None, stride, padding, dilation, transposed, output_padding,
                            groups, round_once=False)
    _, vjp = jax.vjp(f, x, w)
    gx, gw = vjp(grad)
    nd = x.ndim - 2
    gb = jnp.sum(grad, axis=(0,) + tuple(range(2, 2 + nd))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


def _bn_stats_shape(x):
    return (1, -1) + (1,) * (x.ndim - 2)


def _batch_norm_train(x, weight, bias, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    xf = x.astype(np.float32) if x.dtype in HALF_FLOATS else x
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
    mean, rstd = _running_stats(running_mean, running_var, eps)
    out = (_widened(x) - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(x.dtype)


def _widened(x):
    """``x`` in float32 when it is a 16-bit float (ATen's CPU kernels compute in float32)."""
    return x.astype(np.float32) if x.dtype in HALF_FLOATS else x


def _running_stats(running_mean, running_var, eps):
    """The mean and ``1 / sqrt(var + eps)`` of running statistics, in float32 when 16-bit."""
    return _widened(running_mean), lax.rsqrt(_widened(running_var) + eps)


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
    # No statistics in eval mode: eager CPU gives them empty, PyTorch's meta kernel (as CUDA) one
    # float32 per channel, which xshard conforms to.
    empty = jnp.zeros(x.shape[1:2], np.float32)
    return out, empty, empty, running_mean, running_var


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
        mean, rstd = _running_stats(running_mean, running_var, eps)
    gf = _widened(grad)
    xhat = (_widened(x) - mean.reshape(shape)) * rstd.reshape(shape)
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
    xf = x.astype(np.float32) if x.dtype in HALF_FLOATS else x
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    # One correction pass: the rounding of the sum is left in ``mean``, and a row of equal values
    # would normalise to noise (1e-4 after eps = 1e-5) where ATen gives exactly 0.
    mean = mean + jnp.mean(xf - mean, axis=axes, keepdims=True)
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
    out = combine(out, tuple(lead_idx[:-1]) + (i,), g, "add")
    return out.reshape(x.shape)


@rule(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    nd = len(kernel_size) if isinstance(kernel_size, (list, tuple)) and len(kernel_size) > 1 \
        else (2 if x.ndim in (3, 4) else 3)
    kernel, stride, padding, _ = _norm_pool_args(nd, kernel_size, stride, padding)
    dtype = x.dtype
    if dtype in (jnp.bfloat16, jnp.float16):  # summed and divided in float32, as ATen does
        x = x.astype(jnp.float32)
    lead = x.ndim - nd
    pads = _pool_pads(x.shape[-nd:], kernel, stride, padding, (1,) * nd, ceil_mode)
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    full_pads = [(0, 0)] * lead + pads
    # A concrete (numpy) zero: lax.reduce_window then recognises a sum, which JAX can differentiate.
    total = lax.reduce_window(x, np.zeros((), x.dtype), lax.add, window, strides, full_pads)
    if divisor_override:
        return (total / divisor_override).astype(dtype)
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
    return (total / counts).astype(dtype)


@rule(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    _, vjp = jax.vjp(lambda v: _avg_pool(v, kernel_size, stride, padding, ceil_mode,
                                         count_include_pad, divisor_override), x)
    return vjp(grad)[0]


def _adaptive_bounds(size, out):
    return [((i * size) // out, -(-((i + 1) * size) // out)) for i in range(out)]


@rule(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
@in_float32  # one axis at a time: 16-bit means rounded between axes were 2,500 ulps off
def _adaptive_avg_pool(x, output_size):
    nd = len(output_size)
    if 0 in output_size:
        return jnp.zeros(x.shape[:x.ndim - nd] + tuple(output_size), x.dtype)
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


def _adaptive_avg_pool_backward(nd: int):
    # The pooled dims come from the op: a 4-D input is a batch of 2-D images or one 3-D volume.
    def backward(grad, x):
        _, vjp = jax.vjp(lambda v: _adaptive_avg_pool(v, grad.shape[-nd:]), x)
        return vjp(grad)[0]
    return backward


rule(aten._adaptive_avg_pool2d_backward.default)(_adaptive_avg_pool_backward(2))
rule(aten._adaptive_avg_pool3d_backward.default)(_adaptive_avg_pool_backward(3))


@rule(aten.nll_loss_forward.default)
def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    target = target.astype(np.int64)  # uint8 targets: -100 is no uint8
    squeeze = x.ndim == 1  # one sample: its unreduced loss is 0-d
    if squeeze:
        x = x[None]
        target = target[None]
    picked = -jnp.take_along_axis(x, jnp.clip(target, 0, x.shape[1] - 1)[:, None], axis=1)[:, 0]
    wt = _class_weights(x, target, weight, ignore_index)
    losses = jnp.where(target != ignore_index, picked * wt, 0)  # an ignored row is 0, even NaN
    # A class out of range, which eager refuses, is NaN (see [Note: indices out of range]).
    losses = jnp.where(_out_of_range(x, target, ignore_index), jnp.nan, losses)
    total_weight = jnp.sum(wt)
    if reduction == 0:
        return losses[0] if squeeze else losses, jnp.zeros((), x.dtype)
    if reduction == 1:
        return jnp.sum(losses) / total_weight, total_weight
    return jnp.sum(losses), total_weight


@rule(aten.nll_loss_backward.default)
def _nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    target = target.astype(np.int64)
    squeeze = x.ndim == 1
    if squeeze:
        x = x[None]
        target = target[None]
    wt = _class_weights(x, target, weight, ignore_index)
    if reduction == 0:
        g = grad.reshape(-1) * wt
    elif reduction == 1:
        g = wt * (grad / total_weight)  # ATen's order: 0 * (g / 0) is NaN, as in eager
    else:
        g = grad * wt
    # ATen writes no gradient into an ignored row: 0 even where every row is ignored (a mean's
    # total weight 0) or the incoming gradient is not finite.
    g = jnp.where(target != ignore_index, g, jnp.zeros((), g.dtype))
    # -g at each row's target column: an elementwise select (a scatter into zeros at (row, target)
    # would make the SPMD partitioner gather the targets of every device, the rows being implicit).
    hit = jnp.clip(target, 0, x.shape[1] - 1)[:, None] == jnp.arange(x.shape[1])
    out = jnp.where(hit, -g.astype(x.dtype)[:, None], jnp.zeros((), x.dtype))
    out = jnp.where(_out_of_range(x, target, ignore_index)[:, None], jnp.nan, out)
    return out[0] if squeeze else out


def _out_of_range(x, target, ignore_index):
    """Rows whose target is no class of ``x`` (nor ``ignore_index``)."""
    return (target != ignore_index) & ((target < 0) | (target >= x.shape[1]))


def _class_weights(x, target, weight, ignore_index):
    """Each row's weight: its target class's (1 without ``weight``), 0 where ignored."""
    valid = target != ignore_index
    if weight is None:
        return astype(valid, x.dtype)
    return jnp.where(valid, weight[jnp.clip(target, 0, x.shape[1] - 1)], 0)


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
