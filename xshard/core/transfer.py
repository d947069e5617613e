"""Transfers and copies between the host and the device, and reads of values.

Host data reaches the device as data nodes (``execute.upload_node``): into an annotated tensor it is
written straight into its shards, never as a replicated copy on every device. Reading a value runs
pending work first (``execute.to_cpu``).
"""

from __future__ import annotations

import torch

from xshard.core import ir
from xshard.core.backend import DEVICE_TYPE
from xshard.core.cells import LazyTensor
from xshard.core.dtypes import to_numpy_dtype
from xshard.core.execute import to_cpu, upload_node
from xshard.core.padding import pad_host
from xshard.core.record import clone, convert, expand

aten = torch.ops.aten


def copy_(dst, src):
    """``dst.copy_(src)`` where either is an xshard tensor."""
    if not isinstance(src, torch.Tensor):  # t.copy_(3): eager PyTorch accepts a number
        src = torch.tensor(src)
    if isinstance(dst, LazyTensor):
        annotation = dst._cell.sharding
        if annotation is not None and not isinstance(src, LazyTensor) and not dst._chain and \
                tuple(src.shape) == tuple(dst.shape) and src.dtype == dst.dtype:
            # Host data into an annotated tensor (loading a checkpoint into sharded parameters):
            # straight into its shards, never a replicated copy on every device.
            dst._assign(upload_annotated(src, annotation))
            return dst
        value = src._value() if isinstance(src, LazyTensor) else upload_node(src)
        if tuple(value.shape) != tuple(dst.shape):
            torch.broadcast_shapes(value.shape, dst.shape)  # raises PyTorch's own error
            value = expand(value, dst.shape)
        if value.dtype != dst.dtype:
            value = convert(value, dst.dtype)
        dst._assign(value)
        return dst
    dst.copy_(to_cpu(src))
    return dst


def upload_annotated(t: torch.Tensor, annotation) -> ir.Node:
    """CPU tensor ``t`` uploaded as ``annotation`` lays it out (padded where a dim doesn't divide)."""
    logical = tuple(t.shape)
    t = pad_host(t, annotation.padded_shape(logical))
    node = upload_node(t.contiguous(), annotation.jax_sharding)
    return ir.data_node(node.payload, logical, node.dtype, node.sharding)


def to_copy(src, kwargs):
    """``src.to(...)``: to the host, a CPU tensor; on the device, ``(node, stride, annotation)``
    of the copy."""
    device = kwargs.get("device")
    dtype = kwargs.get("dtype") or src.dtype
    if device is not None and torch.device(device).type != DEVICE_TYPE:
        out = to_cpu(src).to(device=device, dtype=dtype)
        if kwargs.get("memory_format") not in (None, torch.preserve_format):
            out = out.contiguous(memory_format=kwargs["memory_format"])
        return out
    value = src._value()
    if dtype != value.dtype:
        to_numpy_dtype(dtype)  # a dtype XLA lacks (complex32) raises here, not at the next sync
        value = convert(value, dtype)
    else:
        value = clone(value)
    memory_format = kwargs.get("memory_format")
    stride = None
    if memory_format in (None, torch.preserve_format) and src.is_contiguous():
        stride = src.stride()
    elif memory_format is not None and memory_format is not torch.preserve_format:
        stride = torch.empty(src.shape, device="meta").contiguous(
            memory_format=memory_format).stride()
    annotation = src._cell.sharding if not src._chain else None
    return value, stride, annotation


def item(t):
    """``t.item()``: the value of a one-element tensor as a Python number."""
    return to_cpu(t).item()
