"""Uneven shardings: padding a value to its sharded layout, and cropping it back.

jax.Array refuses a dimension that does not divide evenly over its shards, so data laid out by such
an annotation is stored padded at the end of each dimension (the annotation's ``padded_shape``),
and read back by cropping the leading block. These functions are the only places that do it: on
the host (torch tensors), on the device (jax values, inside a traced program) and in the IR
(pending values: a manual region's padded operands and cropped results).
"""

from __future__ import annotations

import torch

from xshard.core import ir, runtime


def leading(shape) -> tuple:
    """The index of the leading block of ``shape`` inside a larger (padded) value."""
    return tuple(slice(0, n) for n in shape)


def pad_host(t: torch.Tensor, padded) -> torch.Tensor:
    """``t`` zero-padded at the end of each dimension to ``padded`` (``t`` itself if equal)."""
    padded = tuple(padded)
    if tuple(t.shape) == padded:
        return t
    full = t.new_zeros(padded)
    full[leading(t.shape)] = t
    return full


def crop_host(t: torch.Tensor, logical) -> torch.Tensor:
    """The leading ``logical`` block of ``t``, as its own tensor (``t`` itself if equal)."""
    logical = tuple(logical)
    return t if tuple(t.shape) == logical else t[leading(logical)].clone()


def pad_array(x, padded):
    """Jax value ``x`` zero-padded at the end of each dimension to ``padded``."""
    lax = runtime.jax_module().lax
    pads = [(0, p - n, 0) for n, p in zip(x.shape, padded)]
    if not any(hi for _, hi, _ in pads):
        return x
    return lax.pad(x, lax.full((), 0, x.dtype), pads)


def crop_array(x, logical):
    """The leading ``logical`` block of jax value ``x``."""
    logical = tuple(logical)
    return x if tuple(x.shape) == logical else x[leading(logical)]


def pad_node(value: ir.Node, padded) -> ir.Node:
    """Pending ``value`` zero-padded at the end of each dimension to ``padded`` (``value`` itself
    if equal)."""
    padded = tuple(padded)
    if tuple(value.shape) == padded:
        return value
    # constant_pad_nd lists (before, after) pairs from the last dimension to the first.
    pads = tuple(x for n, p in reversed(list(zip(value.shape, padded))) for x in (0, p - n))
    return ir.Node(torch.ops.aten.constant_pad_nd.default, (value,), ((ir.slot(0), pads), ()),
                   padded, value.dtype)


def crop_node(value: ir.Node, logical) -> ir.Node:
    """The leading ``logical`` block of pending ``value`` (``value`` itself if equal)."""
    for dim, n in enumerate(logical):
        if value.shape[dim] != n:
            shape = tuple(n if d == dim else s for d, s in enumerate(value.shape))
            value = ir.Node(torch.ops.aten.slice.Tensor, (value,),
                            ((ir.slot(0), dim, 0, n, 1), ()), shape, value.dtype)
    return value
