"""Kernels of the xshard device: factories called with ``device=xshard`` record nodes.

``register()`` runs once, when xshard is imported.
"""

from __future__ import annotations

import functools

import torch

from xshard.core import tensor
from xshard.core.backend import DEVICE
from xshard.core.tensor import XTensor

FACTORIES = (
    "empty.memory_format", "empty_strided", "full", "zeros", "ones", "arange.start_step",
    "arange", "arange.start",
    "eye", "eye.m", "linspace", "logspace", "rand", "randn", "randint", "randint.low",
    "randperm", "scalar_tensor", "empty_like", "tril_indices", "triu_indices",
    "_efficientzerotensor",  # a derivative known to be zero (abs in double backward)
)

_LIB = None


@functools.cache
def register() -> None:
    """Registers the factory kernels of the xshard device and tells torch.optim about XTensor."""
    global _LIB
    _LIB = torch.library.Library("aten", "IMPL")
    for name in FACTORIES:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        _LIB.impl(name, _factory_kernel(op), "PrivateUse1")
    # copy_ between devices with the Python key excluded (torch.tensor(data, device=...)).
    _LIB.impl("_copy_from", _copy_from_kernel, "PrivateUse1")
    # .item() with the Python key excluded (torch.as_tensor([t0, t1]) of 0-d device tensors).
    _LIB.impl("_local_scalar_dense", _local_scalar_dense_kernel, "PrivateUse1")
    # torch.optim picks its fast foreach implementation only for tensor types it knows.
    from torch.optim import optimizer

    if XTensor not in optimizer._foreach_supported_types:
        optimizer._foreach_supported_types.append(XTensor)


# The kernels look xshard's functions up when called (xshard.step.dynamo wraps them).
def _factory_kernel(op):
    def kernel(*args, **kwargs):
        return tensor.factory(op, args, kwargs)
    return kernel


def _copy_from_kernel(src, dst, non_blocking=False):
    return tensor.copy_from(src, dst, non_blocking)


def _local_scalar_dense_kernel(t):
    return tensor.local_scalar_dense(t)


def device() -> torch.device:
    """The xshard device (``xshard:0``): one logical device over all the physical ones."""
    return DEVICE
