"""Uneven shardings: padding a value to its sharded layout, and cropping it back.

jax.Array refuses a dimension that does not divide evenly over its shards, so data laid out by such
an annotation is stored padded at the end of each dimension (the annotation's ``padded_shape``),
and read back by cropping the leading block. These four functions are the only places that do it:
on the host (torch tensors) and on the device (jax values, inside a traced program).
"""

from __future__ import annotations

import torch

from xshard.core import runtime


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
