"""The last resort: an op xshard cannot record runs eagerly on CPU copies of its inputs.

Counted in metrics and warned once per op, by name: a fallback reads its inputs' values (running
pending work) and uploads its results, so it splits a step in two.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_map

from xshard.core import capture, metrics
from xshard.core.backend import DEVICE_TYPE
from xshard.core.cells import LazyTensor, contiguous_strides
from xshard.core.execute import to_cpu, upload_node
from xshard.core.ops import facts

_WARNED: set = set()


def cpu_fallback(func, args, kwargs, new_tensor):
    """Runs ``func`` on CPU copies of the inputs; results come back as device tensors made by
    ``new_tensor(node, stride)``, arguments it writes are written back."""
    capture.check_fallback(func)  # a step being recorded by xshard.compile refuses it
    metrics.count_fallback(str(func))
    if id(func) not in _WARNED:
        _WARNED.add(id(func))
        warnings.warn(
            f"xshard has no lowering for {func}; it runs eagerly on CPU (slow: the inputs are "
            f"computed and copied to the host). Counted in xshard.metrics.snapshot()"
            f"['cpu_fallbacks'].", stacklevel=4)
    moved = {}

    def to_host(x):
        if isinstance(x, LazyTensor):
            cpu = to_cpu(x)
            moved[id(cpu)] = x
            return cpu
        if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
            return torch.device("cpu")
        return x

    cargs = tree_map(to_host, args)
    ckwargs = tree_map(to_host, kwargs)
    out = func(*cargs, **ckwargs)
    written = facts(func).written
    if written:
        names = [a.name for a in func._schema.arguments]
        bound_cpu = {**dict(zip(names, cargs)), **ckwargs}
        bound_dev = {**dict(zip(names, args)), **kwargs}
        for name in written:
            cpu_vals, dev_vals = bound_cpu[name], bound_dev[name]
            pairs = zip(cpu_vals, dev_vals) if isinstance(cpu_vals, (list, tuple)) else [
                (cpu_vals, dev_vals)]
            for c, d in pairs:
                if isinstance(d, LazyTensor):
                    d._assign(upload_node(c))

    def to_dev(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in moved:
            return moved[id(x)]
        if x.is_nested:
            raise NotImplementedError(
                f"{func} returns a nested tensor, which the xshard device does not hold (XLA "
                f"programs have fixed shapes). nn.TransformerEncoder makes one in eval mode under "
                f"no_grad with a src_key_padding_mask (its inference fast path): build it with "
                f"enable_nested_tensor=False, or call torch.backends.mha.set_fastpath_enabled("
                f"False); padded positions then hold values instead of zeros, mask them if you "
                f"read them.")
        # A dense result keeps its strides (``nonzero`` is column-major, as are many linalg
        # results): ``view``, ``as_strided`` and ``stride()`` then see what eager sees.
        stride = x.stride() if _dense(x.shape, x.stride()) else contiguous_strides(x.shape)
        return new_tensor(upload_node(x.contiguous()), stride)

    return tree_map(to_dev, out)


def _dense(shape, stride) -> bool:
    """Whether strides ``stride`` lay a tensor of ``shape`` out densely, without overlap."""
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size == 0:
            return False
        if size != 1:
            if step != expected:
                return False
            expected *= size
    return True
