"""``torch_xla.amp`` on xshard: autocast to bfloat16 on the xshard device, PyTorch's GradScaler for
it, and ``syncfree`` optimizers (PyTorch's own: see ``xshard.compat.amp.syncfree``).

In a process running torch_xla scripts (``python -m xshard.compat``), ``torch.autocast("xla",
...)`` also means ``torch.autocast("xshard", ...)`` (``xshard.compat.hook``); elsewhere "xla"
autocasts only torch_xla's own tensors, and xshard tensors are untouched.

Example:
    >>> from torch_xla.amp import autocast, GradScaler, syncfree     # doctest: +SKIP
    >>> with autocast(xm.xla_device()):                              # doctest: +SKIP
    ...     loss = model(x).sum()
"""

from __future__ import annotations

import torch

from xshard.compat.amp import syncfree  # noqa: F401  (torch_xla.amp.syncfree)
from xshard.core.backend import DEVICE_TYPE


def autocast(device=None, enabled: bool = True, dtype: torch.dtype | None = None,
             cache_enabled: bool = True):
    """``torch.autocast`` on the xshard device; ``dtype`` defaults to bfloat16 (torch_xla's on
    TPU). ``device`` (an xla device, or None) is accepted for torch_xla's signature."""
    return torch.autocast(DEVICE_TYPE, enabled=enabled,
                          dtype=torch.bfloat16 if dtype is None else dtype,
                          cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the xshard device, with torch_xla's signature
    (``use_zero_grad`` is accepted and has no effect: it chose how torch_xla cleared gradients)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 use_zero_grad: bool = False):
        super().__init__(DEVICE_TYPE, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)


__all__ = ["autocast", "GradScaler", "syncfree"]
