"""``torch.compile`` on xshard tensors: never a crash; the lazy path, and one warning.

Dynamo cannot trace xshard tensors: they are ``__torch_dispatch__`` wrapper subclasses whose
values live in xshard's lazy IR, not in inner tensors Dynamo could fake. Left alone it fails inside
its own machinery (``InternalTorchDynamoError``). So, as soon as ``torch._dynamo`` is imported (by
the first ``torch.compile``), xshard tells it to treat xshard tensors as opaque objects and not to
trace xshard's own code: Dynamo then breaks its graph at each op on an xshard tensor, and those ops
run on xshard's lazy path, with exactly the values they have outside ``torch.compile``. The first
time that happens a warning points to ``xshard.compile``, which compiles a whole training step
(forward, backward, optimizer) into one program.

Dynamo still captures the few ops on xshard's device that take no xshard tensor (a factory such as
``torch.arange(t, device=idx.device)``); no backend but xshard's can compile a graph making xshard
tensors (Inductor has no code generator for the device, ``openxla`` needs torch_xla), so every
backend is wrapped to run such a graph as it is, on the lazy path, and to get the others.

A Dynamo backend named ``xshard`` is registered too (also as the entry point
``torch_dynamo_backends``), so ``torch.compile(fn, backend="xshard")`` is accepted: it runs the
graphs it gets as they are.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import warnings

import torch

from xshard.core import api
from xshard.step.errors import user_stacklevel

# xshard's own code, which Dynamo must call rather than trace (models stay traceable).
_SKIPPED = ("xshard.core", "xshard.spmd", "xshard.fsdp", "xshard.mesh", "xshard.step",
            "xshard.memory")
# The libraries that code calls (Dynamo skips numpy and the standard library already): a frame
# it reaches there while Dynamo is active (JAX tracing a program, a transfer, a read) would
# otherwise be traced by Dynamo, and fail inside it.
_SKIPPED_LIBRARIES = ("jax", "jaxlib", "ml_dtypes", "opt_einsum", "scipy")
_STATE = {"configured": False, "warned": False}


def backend(gm, example_inputs, **kwargs):
    """The ``xshard`` Dynamo backend: runs the captured graph as it is (see the module doc)."""
    return gm.forward


def _on_device(x) -> bool:
    device = getattr(x, "device", None)
    return device is not None and getattr(device, "type", None) == api.DEVICE_TYPE


def makes_xshard_tensors(gm, example_inputs) -> bool:
    """Whether a Dynamo graph reads or makes tensors on xshard's device."""
    if any(_on_device(x) for x in example_inputs):
        return True
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(_on_device(v) for v in values):
            return True
    return False


def _lazy_graphs_on_device(output_graph_class) -> None:
    """Graphs that read or make xshard tensors run as they are (on the lazy path); the others
    reach the backend."""
    call = getattr(output_graph_class, "call_user_compiler", None)
    if call is None or getattr(call, "_xshard", False):
        return  # a PyTorch without this method: such graphs reach the backend

    def call_user_compiler(self, gm, example_inputs):
        if makes_xshard_tensors(gm, example_inputs):
            return gm.forward
        return call(self, gm, example_inputs)

    call_user_compiler._xshard = True
    output_graph_class.call_user_compiler = call_user_compiler


class _NoticingSet(set):
    """Dynamo's ``config.nontraceable_tensor_subclasses``: Dynamo asks it about every tensor-like
    value it is about to trace, so a question about XTensor is the moment to warn (free on the
    lazy path, where Dynamo asks nothing). Dynamo asks about a value's exact type, so the
    subclasses of XTensor (``XLAShardedTensor``) are in it too."""

    def __contains__(self, item):
        if isinstance(item, type) and getattr(item, "_xshard_tensor", False):
            _warn_once()
            return True
        return set.__contains__(self, item)


def _warn_once() -> None:
    if not _STATE["warned"]:
        _STATE["warned"] = True
        warnings.warn(
            "torch.compile does not capture xshard tensors: their ops run on xshard's lazy path, "
            "with the same values as outside torch.compile, and Dynamo breaks its graph at each "
            "of them. To compile a whole training step (forward, backward, optimizer) into one "
            "program, use xshard.compile(step).", stacklevel=user_stacklevel())


def configure(dynamo) -> None:
    """Sets up ``torch._dynamo`` (the module) for xshard tensors, once."""
    if _STATE["configured"]:
        return
    _STATE["configured"] = True
    from xshard.core.tensor import XTensor

    XTensor._xshard_tensor = True
    _kernels_outside_dynamo()
    _augmented_assignments_in_python(XTensor)
    noticing = _NoticingSet(dynamo.config.nontraceable_tensor_subclasses)
    noticing.add(XTensor)
    dynamo.config.nontraceable_tensor_subclasses = noticing
    for name in _SKIPPED + _SKIPPED_LIBRARIES:
        dynamo.trace_rules.add(name)
    _skip_torch_optim(dynamo.trace_rules)
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "xshard" not in _COMPILER_FNS:
        register_backend(backend, name="xshard")
    from torch._dynamo.output_graph import OutputGraph

    _lazy_graphs_on_device(OutputGraph)


def _kernels_outside_dynamo() -> None:
    """Runs xshard's kernels (its tensors' ops, the device's factories and copies) with Dynamo's
    frame hook off. An op on an xshard tensor under ``torch.compile`` runs on the lazy path (a
    graph break), but the hook stays on for the frames it calls: Dynamo tried to trace the code
    JAX generates for a transfer or a compile (a dataclass ``__init__`` from ``<string>``) and
    failed inside itself. Two C calls per op, once Dynamo is loaded."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    from xshard.core import tensor

    def outside(fn):
        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            prior = set_eval_frame(None)
            try:
                return fn(*args, **kwargs)
            finally:
                set_eval_frame(prior)
        return kernel

    # ``dispatch``, not ``__torch_dispatch__``: that one looks at its caller's frame.
    tensor.dispatch = outside(tensor.dispatch)
    tensor.factory = outside(tensor.factory)
    tensor.copy_from = outside(tensor.copy_from)
    tensor.local_scalar_dense = outside(tensor.local_scalar_dense)


_AUGMENTED = ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
              "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
              "__imatmul__")


def _augmented_assignments_in_python(cls) -> None:
    """``x += 1`` on an xshard tensor under ``torch.compile``: Dynamo looks ``__iadd__`` up on the
    opaque object, finds torch.Tensor's C slot, and recurses until RecursionError. A Python
    method (in this skipped module) it calls instead, breaking the graph there."""
    for name in _AUGMENTED:
        slot = getattr(torch.Tensor, name, None)
        if slot is not None and name not in cls.__dict__:
            setattr(cls, name, _calling(slot, name))


def _calling(slot, name):
    def method(self, other):
        return slot(self, other)

    method.__name__ = method.__qualname__ = name
    return method


def _skip_torch_optim(trace_rules) -> None:
    """Dynamo traces torch.optim with ``is_compiling()`` folded to True, which selects code paths
    that are only right when the whole step is captured; with xshard parameters every op breaks
    the graph, and the pieces run with the wrong paths (a ``torch.stack`` of Python floats). So
    optimizer steps run outside Dynamo (eagerly: on the lazy path for xshard tensors)."""
    import glob
    import os

    import torch.optim

    skip = getattr(trace_rules, "FORCE_SKIP_FILES", None)
    if skip is None:
        return
    root = os.path.dirname(os.path.abspath(torch.optim.__file__))
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        skip.add(path.replace(os.sep, "/"))


class _ConfigureOnImport(importlib.abc.MetaPathFinder):
    """Configures ``torch._dynamo`` right after it is first imported (it costs seconds to import,
    so xshard does not import it itself)."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_configure(module):
            exec_module(module)
            configure(module)

        spec.loader.exec_module = exec_and_configure
        return spec


def install() -> None:
    """Configures Dynamo now if it is loaded, else when it is."""
    module = sys.modules.get("torch._dynamo")
    if module is not None and hasattr(module, "trace_rules"):
        configure(module)
    elif not any(isinstance(f, _ConfigureOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _ConfigureOnImport())
