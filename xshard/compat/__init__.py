"""PyTorch/XLA's classic API on xshard, for scripts written for torch_xla.

Run a script unchanged::

    python -m xshard.compat train.py --epochs 3

In that process (and in the processes ``xmp.spawn`` starts from it) ``import torch_xla...`` loads
these modules (``xshard.compat.hook``); nowhere else, so a real torch_xla installed beside xshard
is untouched. Or edit the imports:

==========================================  ========================================
torch_xla                                   xshard.compat
==========================================  ========================================
``torch_xla``                               ``xshard.compat`` (this module)
``torch_xla.core.xla_model as xm``          ``xshard.compat.xla_model``
``torch_xla.distributed.parallel_loader``   ``xshard.compat.parallel_loader``
``torch_xla.distributed.xla_multiprocessing``  ``xshard.compat.xla_multiprocessing``
``torch_xla.runtime as xr``                 ``xshard.compat.runtime``
``torch_xla.distributed.spmd as xs``        ``xshard.compat.spmd``
``torch_xla.distributed.fsdp``              ``xshard.compat.fsdp``
==========================================  ========================================

The device is ``xshard``, not ``xla``: use ``xm.xla_device()`` / ``torch_xla.device()`` rather
than ``'xla'`` strings. ``xmp.spawn(fn, nprocs=N)`` runs N processes, one device each, whose
``xm.optimizer_step`` averages gradients (PyTorch/XLA's multi-process data parallel); everything
else is one program over every device (torch_xla's SPMD mode).

Example:
    >>> import xshard.compat as torch_xla
    >>> x = torch.ones(2, device=torch_xla.device())
    >>> torch_xla.sync()
"""

from __future__ import annotations

import contextlib

import xshard
from xshard.compat import runtime, xla_model  # noqa: F401  (torch_xla.runtime after import)

__version__ = "2.9.0+xshard"


def device(index: int | None = None):
    """This process's device, ``xshard:0`` (``xm.xla_device(index)``)."""
    return xla_model.xla_device(index)


def devices() -> list:
    """The devices this process can name: ``[xshard:0]``."""
    return [xshard.device()]


def device_count() -> int:
    """How many devices this process can name: 1 (one logical device)."""
    return 1


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """Ends the step (``xm.mark_step``): runs the pending work, then the step closures."""
    xla_model.mark_step(wait=wait, reset_scope=reset_scope)


@contextlib.contextmanager
def step():
    """Context manager ending the step on exit (``with torch_xla.step(): ...``)."""
    try:
        yield
    finally:
        sync()


def manual_seed(seed: int, device=None) -> None:
    """Seeds the device random stream (``xm.set_rng_state``)."""
    xla_model.set_rng_state(seed, device)


def launch(fn, args=(), start_method: str = "spawn", debug_single_process: bool = False):
    """``xmp.spawn(fn, args)``: one process per local device (one with
    ``debug_single_process``)."""
    from xshard.compat import xla_multiprocessing

    return xla_multiprocessing.spawn(fn, args, nprocs=1 if debug_single_process else None,
                                     start_method=start_method)


def __getattr__(name: str):
    if name == "_XLAC":
        raise AttributeError("torch_xla._XLAC (torch_xla's C++ bindings) does not exist in "
                             "xshard.compat; use xshard.metrics, xshard.debug and "
                             "torch_xla.core.xla_model.")
    if name == "compile":
        raise AttributeError("torch_xla.compile is not provided by xshard.compat; use "
                             "xshard.compile(step) to trace a step once.")
    raise AttributeError(f"module 'torch_xla' (xshard.compat) has no attribute {name!r}")


__all__ = ["device", "devices", "device_count", "sync", "step", "manual_seed", "launch",
           "runtime", "xla_model", "__version__"]
