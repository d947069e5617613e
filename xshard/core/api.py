"""What core offers the layers above it (spmd, fsdp, memory, checkpoint, compile, compat).

Code outside ``xshard.core`` reads and writes xshard tensors through these functions, never through
a tensor's private attributes, so the core can change its insides without breaking the others.
Graph-level work uses the core modules' public functions directly (``ir`` to build nodes,
``execute`` to run them, ``compiler`` to compile a ``graph.Graph``).

Terms (see [Note: cells and views] in ``xshard.core.cells``):

- a tensor's **value** is an IR node (``xshard.core.ir.Node``): device data, or pending work;
- its **storage** is shared by a base tensor and all views of it; it carries the **annotation** (a
  sharding, opaque to core: an object with ``jax_sharding`` and ``padded_shape(shape)``);
- a value is **settled** when a sync need not compute it (device data, or a partial sum of it).
"""

from __future__ import annotations

import operator

import torch

from xshard.core import capture, cells, compiler, execute, ir, padding, placement, transfer
from xshard.core.backend import DEVICE_TYPE
from xshard.core.tensor import XTensor, _view_tensor, new_base

__all__ = ["XTensor", "DEVICE_TYPE", "is_device_tensor", "value", "write", "is_view", "storage",
           "annotation", "set_annotation", "new_tensor", "alias", "view_spec", "view_of",
           "settled", "storage_data", "array", "sync", "evaluate", "to_cpu", "upload", "data_node",
           "data_node_maker", "constrain", "default_sharding", "error", "relayout",
           "upload_annotated", "pad_host", "crop_host", "pad_node", "crop_node", "storage_value",
           "storage_version", "count_write", "write_storage", "live_storages", "pending_storages", "quarantine", "executable",
           "placed"]


def is_device_tensor(x) -> bool:
    """Whether ``x`` is a tensor on the xshard device."""
    return isinstance(x, XTensor)


def value(t: XTensor) -> ir.Node:
    """The IR node of ``t``'s current value (through its views)."""
    return t._value()


def write(t: XTensor, node: ir.Node) -> None:
    """Writes ``node`` (same shape and dtype as ``t``) into ``t``, seen by its base and views."""
    t._assign(node)


def is_view(t: XTensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage."""
    return bool(t._chain)


# storage(t): the storage ``t`` shares with its base and views (an identity: compare with ``is``,
# or use as a dict key). An attrgetter, not a function: a compiled step's guard calls it for
# every tensor of the state on every call.
storage = operator.attrgetter("_cell")


def annotation(t: XTensor):
    """The sharding annotation of ``t``'s storage, or None."""
    return t._cell.sharding


def set_annotation(t: XTensor, annotation) -> None:
    """Sets the annotation of ``t``'s storage; every later result of a sync for it is laid out so.

    This records the annotation only: moving existing data is the caller's business.
    """
    t._cell.sharding = annotation


def new_tensor(node: ir.Node, annotation=None, requires_grad: bool = False) -> XTensor:
    """A fresh base tensor holding ``node``, with its own storage (annotated if given)."""
    return new_base(node, requires_grad=requires_grad, sharding=annotation)


def alias(t: XTensor, cls=XTensor) -> XTensor:
    """A new tensor object of class ``cls`` (XTensor or a subclass) sharing ``t``'s storage and
    view."""
    return XTensor.__new__(cls, t._cell, t._chain, t.shape, t.stride(), t.dtype,
                           storage_offset=t.storage_offset())


def view_spec(t: XTensor):
    """How ``t`` views its storage (an opaque value for ``view_of``)."""
    return (t._chain, tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


def view_of(base: XTensor, spec) -> XTensor:
    """The view described by ``spec`` (from ``view_spec``) of ``base``'s storage."""
    chain, shape, stride, dtype, offset = spec
    return _view_tensor(base, chain, shape, stride, dtype, offset)


def settled(t: XTensor) -> bool:
    """Whether ``t``'s storage needs no computation in a sync."""
    return cells.settled(t._cell.value)


def storage_data(t: XTensor) -> tuple:
    """The data nodes ``t``'s storage holds or, pending, reads: its value when settled, and the
    data it held before its pending value (what a step that overwrites it reads)."""
    cell = t._cell
    return tuple(n for n in (cell.value, cell.source) if n is not None and n.op is ir.DATA)


def error(t: XTensor):
    """The exception the step computing ``t`` raised, or None."""
    return t._cell.error


def array(t: XTensor):
    """The ``jax.Array`` holding a base tensor's value, running pending work first.

    The array may be padded at the end of each dimension (an uneven sharding); ``t.shape`` is the
    logical shape.
    """
    if t._chain:
        raise ValueError("array() reads a base tensor's storage; this tensor is a view. Read "
                         "t.clone(), or the base tensor.")
    if not cells.settled(t._cell.value):
        capture.check_read("reading a tensor's device array")
        execute.sync()
    node = t._cell.value
    if node.op is ir.PARTIAL_SUM:
        raise ValueError("this tensor holds per-device partial sums (FSDP no_sync); read it after "
                         "the step that reduces them.")
    if node.op is not ir.DATA:
        raise t._cell.error or RuntimeError("this tensor's value could not be computed")
    return node.payload


def sync(wait: bool = False) -> None:
    execute.sync(wait=wait)


def evaluate(nodes) -> list:
    """Computes ``nodes`` (a list of IR nodes) without binding the results to any tensor."""
    return execute.evaluate(nodes)


def to_cpu(t: XTensor) -> torch.Tensor:
    """``t``'s value as a CPU tensor (runs pending work first)."""
    return execute.to_cpu(t)


def upload(cpu: torch.Tensor, jax_sharding=None) -> ir.Node:
    """A data node holding a copy of CPU tensor ``cpu`` laid out by ``jax_sharding`` (default:
    replicated on every device)."""
    return execute.upload_node(cpu, jax_sharding)


def data_node(array, shape, dtype) -> ir.Node:
    """A data node over ``jax.Array`` ``array``; ``shape`` is the logical (unpadded) shape."""
    return ir.data_node(array, tuple(shape), dtype, getattr(array, "sharding", None))


def data_node_maker(shape, dtype, sharding):
    """A function ``array -> data_node(array, shape, dtype)`` for arrays laid out as ``sharding``
    (a jax sharding), faster than ``data_node`` when many such nodes are made."""
    return ir.data_node_maker(tuple(shape), dtype, sharding)


def constrain(node: ir.Node, annotation) -> ir.Node:
    """``node`` constrained to be laid out as ``annotation`` says at this point of the graph."""
    return ir.constrain(node, annotation.jax_sharding)


def default_sharding():
    """The jax sharding of unannotated data: replicated over every device."""
    return placement.default_sharding()


def relayout(node: ir.Node, jax_sharding, padded_shape=None) -> ir.Node:
    """Device data ``node`` laid out by ``jax_sharding``, over any devices in any order (a mesh
    over a subset of the devices, or listing them in another order), padded with zeros at the end
    of each dim to ``padded_shape`` (default: the logical shape; a padded ``node`` is cropped
    first); ``node`` itself when it is laid out so already."""
    return placement.relayout(node, jax_sharding, padded_shape)


def upload_annotated(cpu: torch.Tensor, annotation) -> ir.Node:
    """A data node holding a copy of CPU tensor ``cpu`` laid out as ``annotation`` says: written
    straight into its shards (padded at the end where a dim does not divide), never as a
    replicated copy on every device."""
    return transfer.upload_annotated(cpu, annotation)


# One padding and cropping, wherever a value lives (see xshard.core.padding): a CPU tensor, a
# pending value.
pad_host = padding.pad_host
crop_host = padding.crop_host
pad_node = padding.pad_node
crop_node = padding.crop_node



# -- storages and whole programs (xshard.step records a step once and replays its program) --------


# storage_value(storage): the IR node a storage (``storage(t)``) holds, its base tensor's value
# (an attrgetter, as ``storage``); storage_version(storage): how many times it was written.
storage_value = operator.attrgetter("value")
storage_version = operator.attrgetter("version")


def write_storage(storage, node: ir.Node) -> None:
    """Writes ``node`` (of the storage's shape and dtype) into a storage, for every tensor on it."""
    storage.write(node)


def write_data(storage, node: ir.Node) -> None:
    """``write_storage`` for a data node, faster when the storage holds data already."""
    storage.write_data(node)


def count_write(storage) -> None:
    """Counts a write into ``storage`` whose data node now holds another value (a compiled step
    moved a packed node to the next pack: see [Note: packed state] in xshard/step/packing.py)."""
    storage.version += 1


def live_storages() -> list:
    """Every storage some tensor still references."""
    return cells.live_cells()


def pending_storages() -> list:
    """The storages whose value a sync would compute (not those left out with an error), in
    creation order."""
    return [c for c in cells.pending_cells() if c.error is None]


def quarantine(storage, error: Exception) -> None:
    """Leaves a storage's pending value out of every later sync; reading it raises ``error``."""
    storage.error = error


def executable(graph, donate: tuple = ()):
    """The executable (``xshard.core.compiler.Executable``) of ``graph`` (an
    ``xshard.core.graph.Graph``), from the cache or compiled now (counted in metrics); ``donate``:
    input positions whose buffers it may take, for that compilation. Raises when an input has no
    data (``compile_only()``)."""
    execute._check_runnable(graph)
    return compiler.executable(graph, donate)


def placed(array):
    """A result array where a sync would store it (replicated over every device when it came out
    on one device of several)."""
    return execute._placed(array)
