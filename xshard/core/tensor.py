"""The xshard tensor: a PyTorch wrapper subclass on the xshard device whose value is a lazy IR node.

[Note: cells and views]
Every base tensor owns a ``Cell``: the current value (a ``Node``) of its whole data, and a version that
counts writes. A view shares its base's cell and records the chain of view ops (``ViewStep``) that lead
from the cell's value to its own. Reading a view replays the chain on the cell's current value (cached
per version); writing a view replays it to get each parent's value and then scatters the new value
back up the chain (``slice_scatter``, ``select_scatter``, an inverse permute, ...). So a mutation
through any view, or a view of a view, is seen by the base and by every other view of it, exactly as
in eager PyTorch, while the IR stays purely functional.
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch

from xshard.core import ir
from xshard.core.backend import DEVICE_TYPE
DEVICE = torch.device(DEVICE_TYPE, 0)

aten = torch.ops.aten


class Cell:
    """The storage of a base tensor: its current value and a write counter."""

    __slots__ = ("value", "version", "sharding", "seq", "error", "source", "__weakref__")

    def __init__(self, value: ir.Node, sharding=None):
        self.value = value
        self.version = 0
        # Creation order: a sync lists its outputs in this order, so the same program gives the
        # same graph (and cache key) every step.
        self.seq = next(_CELL_SEQ)
        # A sharding annotation (opaque to core; see xshard.spmd). Outputs of a sync keep it.
        self.sharding = sharding
        # The error that compiling this cell's pending value raised: a sync then leaves the cell
        # out (so one bad tensor does not block every later step); reading it raises again.
        self.error = None
        # The device data node this cell held before its current pending value: the input a sync
        # reads for it (xshard.memory attributes graph inputs to parameters and optimizer state
        # by it). None while the value is data, or pending from the start.
        self.source = None
        LIVE_CELLS.add(self)

    def write(self, value: ir.Node) -> None:
        if value.is_data:
            self.source = None
        elif self.value.is_data:
            self.source = self.value
        self.value = value
        self.version += 1
        self.error = None


_CELL_SEQ = itertools.count()
# Every cell some tensor still references; a sync computes the pending ones.
LIVE_CELLS: "weakref.WeakSet[Cell]" = weakref.WeakSet()


class ViewStep:
    """One view op of a chain: ``op`` applied to the parent (``Slot(0)``) with static ``template``.

    ``template`` has the node form ``(args, kwargs)``; the parent is always ``args[0]``.
    """

    __slots__ = ("op", "template", "shape", "dtype", "parent_shape")

    def __init__(self, op, template, shape, dtype, parent_shape):
        self.op = op
        self.template = template
        self.shape = shape
        self.dtype = dtype
        self.parent_shape = parent_shape

    def apply(self, parent: ir.Node) -> ir.Node:
        return ir.Node(self.op, (parent,), self.template, self.shape, self.dtype)

    def scatter(self, parent: ir.Node, value: ir.Node) -> ir.Node:
        """The parent's new value after ``value`` is written into this view of it."""
        rule = _SCATTER.get(self.op)
        if rule is None:
            raise NotImplementedError(
                f"xshard cannot write through a view made by {self.op}; clone the view first "
                f"(e.g. y = x.{self.op.__name__.split('.')[0]}(...).clone())."
            )
        return rule(self, parent, value)


def _reshape_back(step, parent, value):
    return ir.Node(aten.view.default, (value,), ((ir.Slot(0), tuple(parent.shape)), ()),
                   parent.shape, parent.dtype)


def _scatter_with(op):
    def rule(step, parent, value):
        static = step.template[0][1:]
        return ir.Node(op, (parent, value), ((ir.Slot(0), ir.Slot(1), *static), ()),
                       parent.shape, parent.dtype)
    return rule


def _permute_back(step, parent, value):
    dims = [d % len(step.shape) for d in step.template[0][1]]
    inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
    return ir.Node(aten.permute.default, (value,), ((ir.Slot(0), inverse), ()), parent.shape,
                   parent.dtype)


def _transpose_back(step, parent, value):
    return ir.Node(step.op, (value,), step.template, parent.shape, parent.dtype)


_SCATTER = {
    aten.view.default: _reshape_back,
    aten._reshape_alias.default: _reshape_back,
    aten.alias.default: _reshape_back,
    aten.detach.default: _reshape_back,
    aten.lift_fresh.default: _reshape_back,
    aten.unsqueeze.default: _reshape_back,
    aten.squeeze.default: _reshape_back,
    aten.squeeze.dim: _reshape_back,
    aten.squeeze.dims: _reshape_back,
    aten.select.int: _scatter_with(aten.select_scatter.default),
    aten.slice.Tensor: _scatter_with(aten.slice_scatter.default),
    aten.diagonal.default: _scatter_with(aten.diagonal_scatter.default),
    aten.as_strided.default: _scatter_with(aten.as_strided_scatter.default),
    aten.permute.default: _permute_back,
    aten.transpose.int: _transpose_back,
    aten.t.default: _transpose_back,
}


class XTensor(torch.Tensor):
    """A tensor on the xshard device. Its value is ``self._cell.value`` seen through ``self._chain``."""

    _cell: Cell
    _chain: tuple
    _cache: ir.Node | None
    _cache_version: int

    @staticmethod
    def __new__(cls, cell: Cell, chain: tuple, shape, stride, dtype, requires_grad=False,
                storage_offset=0):
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, storage_offset=storage_offset, dtype=dtype, device=DEVICE,
            requires_grad=requires_grad)
        t._cell = cell
        t._chain = chain
        t._cache = None
        t._cache_version = -1
        return t

    def __init__(self, *args, **kwargs):
        pass

    # -- values ---------------------------------------------------------------------------------

    def _value(self) -> ir.Node:
        """The IR node of this tensor's current value."""
        cell = self._cell
        if not self._chain:
            return cell.value
        if self._cache_version != cell.version:
            node = cell.value
            for step in self._chain:
                node = step.apply(node)
            self._cache = node
            self._cache_version = cell.version
        return self._cache

    def _assign(self, value: ir.Node) -> None:
        """Writes ``value`` (same shape and dtype as self) into this tensor, through its views."""
        cell = self._cell
        if self._chain:
            parents = [cell.value]
            for step in self._chain[:-1]:
                parents.append(step.apply(parents[-1]))
            for step, parent in zip(reversed(self._chain), reversed(parents)):
                value = step.scatter(parent, value)
        cell.write(value)

    # -- PyTorch protocol -------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents=None):
        from xshard.core import graph

        cpu = graph.to_cpu(self)
        text = repr(cpu)
        suffix = f", device='{self.device}'"
        if text.endswith(")"):
            text = text[:-1] + suffix + ")"
        if self.requires_grad and "requires_grad" not in text:
            text = text[:-1] + ", requires_grad=True)"
        return text

    def tolist(self):
        # PyTorch's C tolist() refuses tensor subclasses; read the value and convert on the host.
        from xshard.core import graph

        return graph.to_cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                f"copy the tensor to host memory first.")
        return self.detach().cpu().numpy()

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        new._cell.sharding = self._cell.sharding
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, val in self.__dict__.items():
            if key not in ("_cell", "_chain", "_cache", "_cache_version"):
                setattr(new, key, copy.deepcopy(val, memo))
        return new

    # [Note: tied parameters] Being a "traceable wrapper subclass" makes Module._apply (behind
    # model.to(device)) swap each parameter object in place instead of replacing it, so parameters
    # shared between modules (tied embeddings) stay one parameter on the device.
    def __tensor_flatten__(self):
        return [], (self._cell, self._chain, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        cell, chain, dtype = ctx
        return XTensor(cell, chain, outer_size, outer_stride, dtype)

    def __reduce_ex__(self, protocol):
        from xshard.core import graph

        return (_rebuild, (graph.to_cpu(self), self.requires_grad))


def _rebuild(cpu_tensor, requires_grad):
    return cpu_tensor.to(DEVICE).requires_grad_(requires_grad)


def _dispatch(func, args, kwargs):
    # Bound at import of xshard.core.dispatch (which imports this module).
    raise RuntimeError("xshard.core.dispatch was not imported")


def new_base(value: ir.Node, stride=None, requires_grad=False, sharding=None) -> XTensor:
    """A fresh base tensor (its own cell) holding ``value``."""
    if stride is None:
        stride = contiguous_strides(value.shape)
    return XTensor(Cell(value, sharding), (), value.shape, stride, value.dtype, requires_grad)


def contiguous_strides(shape) -> tuple:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
