"""Storage of xshard tensors: cells, views, and which values are pending.

[Note: cells and views]
Every base tensor owns a ``Cell``: the current value (a ``Node``) of its whole data, and a version that
counts writes. A view shares its base's cell and records the chain of view ops (``ViewStep``) that lead
from the cell's value to its own. Reading a view replays the chain on the cell's current value (cached
per version); writing a view replays it to get each parent's value and then scatters the new value
back up the chain (``slice_scatter``, ``select_scatter``, an inverse permute, ...). So a mutation
through any view, or a view of a view, is seen by the base and by every other view of it, exactly as
in eager PyTorch, while the IR stays purely functional.

[Note: pending cells and held data]
A sync computes the cells whose value is not settled (see ``settled``). They are tracked as they are
written (``PENDING``), so a sync costs O(pending), not O(live tensors). A sync may donate an input's
buffer to XLA only if no live cell still holds that data: each data node counts the cells holding it
(``Node.holders``), kept up to date by every write and by a cell's death.
"""

from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import torch

from xshard.core import ir

aten = torch.ops.aten


def settled(value: ir.Node) -> bool:
    """Whether ``value`` needs no computation in a sync: device data, or a partial sum of it."""
    op = value.op
    return op is ir.DATA or (op is ir.PARTIAL_SUM and value.inputs[0].op is ir.DATA)


def stored(value: ir.Node) -> ir.Node:
    """The node a sync computes and stores for a cell holding ``value`` (a partial sum keeps its
    rows)."""
    return value.inputs[0] if value.op is ir.PARTIAL_SUM else value


def _hold(value: ir.Node, n: int) -> None:
    if value.op is ir.DATA:
        value.holders += n
    elif value.op is ir.PARTIAL_SUM and value.inputs[0].op is ir.DATA:
        value.inputs[0].holders += n


class Cell:
    """The storage of a base tensor: its current value and a write counter."""

    __slots__ = ("value", "version", "sharding", "seq", "error", "source", "ref", "layout",
                 "__weakref__")

    def __init__(self, value: ir.Node, sharding=None, layout=None):
        self.value = value
        # The strides of the storage's elements in the base tensor's order (None: contiguous):
        # what ``as_strided``'s sizes, strides and offset index.
        self.layout = layout
        self.version = 0
        # Creation order: a sync lists its outputs in this order, so the same program gives the
        # same graph (and cache key) every step.
        self.seq = next(_CELL_SEQ)
        # A sharding annotation (opaque to core; see xshard.spmd). Outputs of a sync keep it.
        self.sharding = sharding
        # The error that computing this cell's pending value raised: a sync then leaves the cell
        # out (so one bad tensor does not block every later step); reading it raises again.
        self.error = None
        # The device data node this cell held before its current pending value: the input a sync
        # reads for it (xshard.memory attributes graph inputs to parameters and optimizer state
        # by it). None while the value is data, or pending from the start.
        self.source = None
        # How the registries below refer to the cell without keeping it alive.
        self.ref = weakref.ref(self)
        _LIVE[id(self)] = self.ref
        if settled(value):
            _hold(value, 1)
        else:
            _PENDING[id(self)] = self.ref

    def write(self, value: ir.Node) -> None:
        old = self.value
        was_settled = settled(old)
        if was_settled:
            _hold(old, -1)
        if settled(value):
            _hold(value, 1)
            self.source = None
            if not was_settled:
                _PENDING.pop(id(self), None)
        else:
            if was_settled:
                _PENDING[id(self)] = self.ref
                if old.op is ir.DATA:
                    self.source = old
        self.value = value
        self.version += 1
        self.error = None

    def write_data(self, value: ir.Node) -> None:
        """``write(value)`` for device data ``value`` (a compiled step's stores, many per call):
        the common case, data replacing data, without the general bookkeeping."""
        old = self.value
        if old.op is not ir.DATA or self.error is not None:
            self.write(value)
            return
        old.holders -= 1
        value.holders += 1
        self.value = value
        self.version += 1

    def __del__(self):
        try:
            _LIVE.pop(id(self), None)
            _PENDING.pop(id(self), None)
            if settled(self.value):
                _hold(self.value, -1)
        except (AttributeError, TypeError):  # interpreter shutdown
            pass


_CELL_SEQ = itertools.count()
# id -> weak reference, of every cell some tensor still references (waits and memory figures walk
# them), and of those whose value is pending (see [Note: pending cells and held data]). A cell
# removes itself when it dies.
_LIVE: dict = {}
_PENDING: dict = {}


def live_cells() -> list:
    """Every live cell."""
    return [c for c in (r() for r in list(_LIVE.values())) if c is not None]


def pending_cells() -> list:
    """The pending cells, in creation order."""
    cells = [c for c in (r() for r in list(_PENDING.values())) if c is not None]
    cells.sort(key=_seq)
    return cells


def _seq(cell: Cell) -> int:
    return cell.seq


class ViewStep:
    """One view op of a chain: ``op`` applied to the parent (``Slot(0)``) with static ``template``.

    ``template`` has the node form ``(args, kwargs)``; the parent is always ``args[0]``.
    """

    __slots__ = ("op", "template", "shape", "dtype", "parent_shape", "key")

    def __init__(self, op, template, shape, dtype, parent_shape):
        self.op = op
        self.template = template
        self.shape = shape
        self.dtype = dtype
        self.parent_shape = parent_shape
        self.key = ir.intern_key((ir.op_code(op), ir.exact(template), shape, dtype, None))

    def apply(self, parent: ir.Node) -> ir.Node:
        return ir.Node(self.op, (parent,), self.template, self.shape, self.dtype, key=self.key)

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
    return ir.Node(aten.view.default, (value,), ((ir.slot(0), tuple(parent.shape)), ()),
                   parent.shape, parent.dtype)


def _scatter_with(op):
    def rule(step, parent, value):
        static = step.template[0][1:]
        return ir.Node(op, (parent, value), ((ir.slot(0), ir.slot(1), *static), ()),
                       parent.shape, parent.dtype)
    return rule


def _strided_back(step, parent, value):
    """Views that pick the parent's elements by strides (expand, unfold, as_strided): the view's
    elements go back to the parent positions they alias. Where two of them alias one position
    (a broadcast expand, overlapping unfold windows) the view's value cannot say which of them a
    write changed, so such writes are refused."""
    static = step.template[0][1:]
    if step.op is aten.as_strided.default:
        size, stride = static[0], static[1]
        offset = (static[2] if len(static) > 2 else None) or 0
    else:
        meta = torch.empty(step.parent_shape, dtype=step.dtype, device="meta")
        view = step.op(meta, *static, **dict(step.template[1]))
        size, stride, offset = tuple(view.shape), tuple(view.stride()), view.storage_offset()
    positions = np.full(tuple(size), offset, np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        along = [-1 if i == d else 1 for i in range(len(size))]
        positions = positions + np.arange(n).reshape(along) * s
    if np.unique(positions).size != math.prod(size):
        raise NotImplementedError(
            f"xshard cannot write through a view made by {step.op} whose elements overlap (a "
            f"broadcast expand, overlapping windows); clone the view first (e.g. y = x."
            f"{step.op.__name__.split('.')[0]}(...).clone()).")
    return ir.Node(aten.as_strided_scatter.default, (parent, value),
                   ((ir.slot(0), ir.slot(1), tuple(size), tuple(stride), offset), ()),
                   parent.shape, parent.dtype)


def _dtype_back(step, parent, value):
    return ir.Node(aten.view.dtype, (value,), ((ir.slot(0), parent.dtype), ()), parent.shape,
                   parent.dtype)


def _complex_back(inverse):
    """``view_as_real`` and ``view_as_complex`` are each other's inverse, ``_conj`` its own."""
    def rule(step, parent, value):
        return ir.Node(inverse, (value,), ((ir.slot(0),), ()), parent.shape, parent.dtype)
    return rule


def _permute_back(step, parent, value):
    dims = [d % len(step.shape) for d in step.template[0][1]]
    inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
    return ir.Node(aten.permute.default, (value,), ((ir.slot(0), inverse), ()), parent.shape,
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
    aten.as_strided.default: _strided_back,
    aten.expand.default: _strided_back,
    aten.unfold.default: _strided_back,
    aten.view.dtype: _dtype_back,
    aten.view_as_real.default: _complex_back(aten.view_as_complex.default),
    aten.view_as_complex.default: _complex_back(aten.view_as_real.default),
    aten._conj.default: _complex_back(aten._conj.default),
    aten.permute.default: _permute_back,
    aten.transpose.int: _transpose_back,
    aten.t.default: _transpose_back,
}


class LazyTensor(torch.Tensor):
    """What every xshard tensor is below the dispatcher: its value is ``self._cell.value`` seen
    through ``self._chain`` of view steps. The class users hold, ``XTensor`` (xshard.core.tensor),
    adds PyTorch's dispatch protocol."""

    _cell: Cell
    _chain: tuple
    _cache: ir.Node | None
    _cache_version: int
    _meta: tuple  # (shape, stride, dtype) as tuples: what the recorder keys a call on

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


def contiguous_strides(shape) -> tuple:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
