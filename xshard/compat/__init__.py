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
import functools
import os
import warnings

import xshard
from xshard.compat import runtime, xla_model  # noqa: F401  (torch_xla.runtime after import)
from xshard.core import capture, trace
from xshard.step import errors

__version__ = "2.9.0+xshard"

for _name in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16", "XLA_USE_FP16"):
    if os.environ.get(_name, "").strip() not in ("", "0"):
        warnings.warn(f"{_name}={os.environ[_name]!r} is ignored by xshard.compat (torch_xla "
                      f"deprecated it): tensors keep the dtypes the program gives them. Cast the "
                      f"model (model.to(torch.bfloat16)) or use torch.autocast('xla', "
                      f"dtype=torch.bfloat16).", stacklevel=2)


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


class _Region:
    """What ``torch_xla.compile`` returns: a context manager and decorator around code whose ops
    make one step (see ``compile``). Its graph count spans every entry of this object."""

    def __init__(self, name, full_graph: bool, max_different_graphs):
        if max_different_graphs is not None and (
                not isinstance(max_different_graphs, int) or max_different_graphs < 1):
            raise ValueError(f"torch_xla.compile(max_different_graphs={max_different_graphs!r}): "
                             f"give a positive int, or None for no limit.")
        self.name = name
        self.full_graph = bool(full_graph)
        self.max_different_graphs = max_different_graphs
        self.graphs: set = set()  # keys of the graphs run inside, over every entry
        self._open: list = []

    def __call__(self, f):
        @functools.wraps(f)
        def compiled(*args, **kwargs):
            with self:
                return f(*args, **kwargs)

        return compiled

    def __enter__(self):
        region = self._region()
        region.__enter__()
        self._open.append(region)
        return self

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)

    @contextlib.contextmanager
    def _region(self):
        sync()  # what came before is its own step
        with contextlib.ExitStack() as stack:
            if self.name:
                stack.enter_context(trace.naming(self.name))
            if self.max_different_graphs is not None:
                trace.GRAPH_WATCHERS.append(self.graphs.add)
                stack.callback(trace.GRAPH_WATCHERS.remove, self.graphs.add)
            try:
                if self.full_graph:
                    with capture.capturing(_OneGraph(self.name)):
                        yield
                else:
                    yield
            finally:
                sync()
        if self.max_different_graphs is not None and \
                len(self.graphs) > self.max_different_graphs:
            raise RuntimeError(
                f"torch_xla.compile({self.name}): max_different_graphs="
                f"{self.max_different_graphs}, but it has run {len(self.graphs)} different graphs "
                f"(this call's results are computed). A new graph comes from new input shapes or "
                f"dtypes, or Python control flow taking another path: pad or bucket the inputs, "
                f"or raise the limit.")


class _OneGraph:
    """The capture owner of ``torch_xla.compile(full_graph=True)``: nothing may run before the
    region ends."""

    def __init__(self, name):
        self.name = name

    def _refuse(self, what: str):
        raise RuntimeError(
            f"torch_xla.compile({self.name}, full_graph=True): {what} at {errors.user_line()} "
            f"would run part of the graph before the function ends, which full_graph=True "
            f"forbids. Move it after the call, or pass full_graph=False.")

    def on_read(self, what: str, tensor) -> bool:
        self._refuse(what)

    def on_fallback(self, op) -> None:
        self._refuse(f"{op}, which has no lowering rule and runs on the CPU,")

    def on_sync(self) -> None:
        self._refuse("a sync (xm.mark_step / torch_xla.sync)")

    def lets_run(self, kind: str) -> bool:
        # Between xmp.spawn replicas each xm collective is a program of its own: the step is
        # then several graphs, as it must be, and is not refused.
        return kind == "replica collective"


def compile(f=None, full_graph: bool = False, name: str | None = None,
            max_different_graphs: int | None = None):
    """torch_xla's ``compile``: the ops of ``f`` (or of a ``with`` block) make one step, synced
    before and after, as torch_xla does. It is the lazy path, traced on every call; for a step
    traced once and replayed without Python, use ``xshard.compile``.

    Args:
        f: the function; None returns a context manager that is also a decorator.
        full_graph: refuse, naming the line, anything that would run part of the graph before
            the end (``.item()``, printing a tensor, an op without a lowering rule, a sync).
        name: the name of the programs compiled inside (default: ``f.__name__``).
        max_different_graphs: raise once the code inside has run more different graphs than
            this (new input shapes, another control-flow path), after the call's step has run.

    Example:
        >>> step = torch_xla.compile(train_step, full_graph=True)   # doctest: +SKIP
        >>> with torch_xla.compile():                                # doctest: +SKIP
        ...     loss = model(x).sum(); loss.backward(); opt.step()
    """
    if name is None and f is not None:
        name = getattr(f, "__name__", None) or str(f)
    region = _Region(name, full_graph, max_different_graphs)
    return region if f is None else region(f)


def step():
    """Context manager making its block one step (``torch_xla.compile()``): syncs on entry and on
    exit."""
    return compile()


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
    raise AttributeError(f"module 'torch_xla' (xshard.compat) has no attribute {name!r}")


__all__ = ["device", "devices", "device_count", "sync", "step", "compile", "manual_seed",
           "launch", "runtime", "xla_model", "__version__"]
