"""Per-device partial sums of a value that sums over a sharded batch: how FSDP's ``no_sync``
accumulates gradients without a collective per micro-step.

[Note: per-device partial sums]
GSPMD has no annotation for a value that each device holds a different addend of (an "unreduced"
value): a logical value is always whole, so XLA reduces a contraction over a sharded dimension
where it happens. The IR op ``PARTIAL_SUM`` spells such a value out: its input has one leading row
per device (sharded on that dimension, so each device holds its own row) and its value is the sum
of the rows. A sync keeps the rows as they are and the cell's value stays ``PARTIAL_SUM(data)``,
which counts as computed (settled); the sum, and with it the collective, happens only in the graph
that reads the value.

A parameter's gradient is a sum over the batch: ``x.T @ dy`` for a Linear weight, a scatter-add of
the output gradient for an embedding, a sum over batch and positions for a norm's weight. With the
batch sharded over the data axes, XLA computes each device's addend locally and then all-reduces
(or reduce-scatters) the result, at the op. ``per_device_rows(value, n)`` rewrites the subgraph that
computes ``value`` so that it yields the addends instead: ``n`` rows whose sum is ``value``, row ``i``
summing over the ``i``-th contiguous block of the batch, which is the block device ``i`` holds. The
rewritten ops are the original ones under ``jax.vmap`` over the blocks, so the rows need no
communication; summing them (once, later) is the only collective.

The rewrite follows linear ops (views, transposes, casts, scaling, addition) down to the ops that sum
over the batch (``_BATCH_SUMS``) and splits those. It is exact for any layout: if the batch is not in
fact sharded that way, XLA moves data to compute the rows, and a value whose subgraph it cannot
rewrite becomes ``value`` in row 0 and zeros elsewhere (reduced where it is computed).
"""

from __future__ import annotations

import math

import torch

from xshard.core import ir
from xshard.core.lowering.xshard_ops import STACKED, per_device_call

aten = torch.ops.aten
BARRIERS = ir.BARRIERS

# How far below the value the rewrite looks for a batch sum through linear ops.
_MAX_DEPTH = 12


def _reduced_dims(node):
    args = node.template[0]
    ndim = len(node.inputs[0].shape)
    if node.op in _FULL_REDUCTIONS or len(args) < 2 or args[1] is None or args[1] == ():
        return tuple(range(ndim))
    dims = args[1] if isinstance(args[1], (list, tuple)) else (args[1],)
    return tuple(d % max(ndim, 1) for d in dims)


_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, *_FULL_REDUCTIONS}


def _split_mm(node, batch):
    return {0: 1, 1: 0} if batch(_arg(node, 0)) == 1 and batch(_arg(node, 1)) == 0 else None


def _split_embedding(node, batch):
    grad, indices = _arg(node, 0), _arg(node, 1)
    d = batch(grad)
    if d is None or d != batch(indices) or grad.shape[:-1] != indices.shape:
        return None
    return {0: d, 1: d}


def _split_sum(node, batch):
    d = batch(_arg(node, 0))
    return {0: d} if d is not None and d in _reduced_dims(node) else None


def _split_layer_norm(node, batch):
    grad = _arg(node, 0)
    d = batch(grad)
    if d is None or d >= len(grad.shape) - len(node.template[0][2]):
        return None
    return {0: d, 1: d, 3: d, 4: d}


def _split_leading(node, batch):
    return {0: 0, 1: 0} if batch(_arg(node, 0)) == 0 else None


# Ops that sum over the batch: op -> (split, outputs). ``split(node, batch)`` gives the dimension
# to cut into blocks per argument position (None when the op does not reduce over the batch here);
# ``outputs``: for a multi-output op, the outputs that are such sums.
_BATCH_SUMS = {
    aten.mm.default: (_split_mm, None),
    aten.embedding_dense_backward.default: (_split_embedding, None),
    aten.sum.dim_IntList: (_split_sum, None),
    aten.sum.default: (_split_sum, None),
    aten.native_layer_norm_backward.default: (_split_layer_norm, (1, 2)),
    aten.native_batch_norm_backward.default: (_split_leading, (1, 2)),
    aten.convolution_backward.default: (_split_leading, (1, 2)),
}

# op -> argument positions in which it is linear (one of them may carry rows, the rest are shared).
_LINEAR = {
    aten.t.default: (0,), aten.transpose.int: (0,), aten.permute.default: (0,),
    aten.view.default: (0,), aten._unsafe_view.default: (0,), aten.reshape.default: (0,),
    aten.unsqueeze.default: (0,), aten.squeeze.dim: (0,), aten.squeeze.dims: (0,),
    aten.squeeze.default: (0,), aten.clone.default: (0,), aten.alias.default: (0,),
    aten._to_copy.default: (0,), aten.neg.default: (0,),
    aten.mul.Tensor: (0, 1), aten.mul.Scalar: (0,), aten.div.Tensor: (0,), aten.div.Scalar: (0,),
    aten.sum.dim_IntList: (0,), aten.sum.default: (0,),
    aten.embedding_dense_backward.default: (0,),
}
_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}


def per_device_rows(value: ir.Node, batch: BatchDims, sharding) -> ir.Node:
    """``batch.n`` rows (shape ``(n, *value.shape)``, laid out by the jax ``sharding``) summing to
    ``value``, computed without reducing over devices where the subgraph allows it."""
    rows = split_rows(value, batch, sharding)
    return ir.constrain(_first_row(value, batch.n), sharding) if rows is None else rows


def split_rows(value: ir.Node, batch: BatchDims, sharding) -> ir.Node | None:
    """``per_device_rows`` where the subgraph computing ``value`` splits over the batch, else
    None."""
    rows = _Rewrite(batch).rows(value, 0)
    return None if rows is None else ir.constrain(rows, sharding)


class _Rewrite:
    def __init__(self, batch: BatchDims):
        self.batch = batch
        self.n = batch.n
        self.memo: dict = {}

    def rows(self, node: ir.Node, depth: int):
        key = id(node)
        if key not in self.memo:
            self.memo[key] = self._rows(node, depth) if depth <= _MAX_DEPTH else None
        return self.memo[key]

    def _rows(self, node, depth):
        op = node.op
        if op == ir.CONSTRAIN:
            return self.rows(node.inputs[0], depth + 1)
        if op is ir.OUTPUT:
            multi, index = node.inputs[0], node.template
            return self._split(multi, index)
        split = self._split(node, None)
        if split is not None:
            return split
        if op in _ADDITIVE:
            return self._additive(node, depth)
        if op in _LINEAR:
            return self._linear(node, depth)
        return None

    def _split(self, node, index):
        """``node`` computed per block of the batch dimensions its ``_BATCH_SUMS`` entry names."""
        entry = _BATCH_SUMS.get(node.op)
        if entry is None:
            return None
        split, outputs = entry
        if (index is None) != (outputs is None) or (index is not None and index not in outputs):
            return None
        dims = split(node, self.batch.dim)
        if dims is None:
            return None
        modes = [None] * len(node.inputs)
        sizes = set()
        for position, d in dims.items():
            slot = _slot_at(node, position)
            if slot is None:
                continue
            modes[slot] = d
            sizes.add(node.inputs[slot].shape[d])
        if len(sizes) != 1 or sizes.pop() % self.n:  # blocks must pair up across the inputs
            return None
        return self._per_device(node, node.inputs, modes, index)

    def _linear(self, node, depth):
        found = []
        for position in _LINEAR[node.op]:
            slot = _slot_at(node, position)
            if slot is not None:
                rows = self.rows(node.inputs[slot], depth + 1)
                if rows is not None:
                    found.append((slot, rows))
        if len(found) != 1:  # none, or a product of two per-device values (not linear)
            return None
        slot, rows = found[0]
        inputs = list(node.inputs)
        inputs[slot] = rows
        modes = [None] * len(inputs)
        modes[slot] = STACKED
        return self._per_device(node, inputs, modes, None)

    def _additive(self, node, depth):
        parts = [self.rows(i, depth + 1) for i in node.inputs]
        if all(p is None for p in parts):
            return None
        inputs, modes = [], []
        for x, rows in zip(node.inputs, parts):
            if rows is None and x.op is not ir.SCALAR and len(x.shape):
                rows = _first_row(x, self.n)  # computed whole: it goes to one row, once
            inputs.append(x if rows is None else rows)
            modes.append(None if rows is None else STACKED)
        if any(m is None for m in modes):
            return None  # a shared scalar term would be added once per row
        return self._per_device(node, inputs, modes, None)

    def _per_device(self, node, inputs, modes, index):
        shape, dtype = (node.shape, node.dtype) if index is None else node.outputs[index]
        call = per_device_call(node.op, node.template, modes, index, shape, dtype, self.n)
        template = ((call, *(ir.slot(i) for i in range(len(inputs)))), ())
        return ir.Node(ir.PER_DEVICE, tuple(inputs), template, (self.n, *shape), dtype)


def _slot_at(node, position):
    """The input index of the tensor at argument ``position`` of ``node``'s call, or None."""
    args = node.template[0]
    if position < len(args) and type(args[position]) is ir.Slot:
        return args[position].index
    return None


def _arg(node, position):
    slot = _slot_at(node, position)
    return None if slot is None else node.inputs[slot]


# -- where the batch is ------------------------------------------------------------------------------


class BatchDims:
    """Which dimension of a value holds the batch split in ``n`` contiguous blocks over the data
    axes ``axes``, as far as the graph shows it: from sharding annotations on data and constraints,
    through views, pointwise ops and ops that keep the leading dimension. None where unknown.

    One instance serves every gradient of a backward pass. Only performance depends on the answer:
    a split is exact along any dimension the op reduces over."""

    def __init__(self, axes: tuple, n: int):
        self.axes = tuple(axes)
        self.n = n
        self.memo: dict = {}

    def dim(self, node):
        if node is None:
            return None
        memo = self.memo
        if id(node) in memo:
            return memo[id(node)][1]
        stack = [node]
        while stack:  # inputs before users, without recursion (graphs are deep)
            top = stack[-1]
            pending = [i for i in _sources(top) if id(i) not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if id(top) not in memo:
                memo[id(top)] = (top, self._infer(top))  # the node is held: its id stays its own
        return memo[id(node)][1]

    def _of(self, node):
        entry = self.memo.get(id(node))
        return None if entry is None else entry[1]

    def _infer(self, node):
        op = node.op
        if op is ir.SCALAR or node.outputs is not None:
            return None
        if op is ir.DATA:
            return self._from_sharding(node.sharding, len(node.shape))
        if op == ir.CONSTRAIN:
            return self._from_sharding(node.template[0][1], len(node.shape))
        if op is ir.OUTPUT:
            multi = node.inputs[0]
            if multi.op in BARRIERS:
                return self._of(multi.inputs[node.template])
            return self._leading(multi.inputs, node.shape)
        x = node.inputs[0] if node.inputs else None
        d = self._of(x) if x is not None else None
        if op in _VIEWS:
            return None if d is None else _reshaped(x.shape, node.shape, d, self.n)
        if op == aten.t.default:
            return None if d is None else 1 - d if len(x.shape) == 2 else d
        if op == aten.transpose.int:
            a, b = (k % len(x.shape) for k in node.template[0][1:3])
            return None if d is None else b if d == a else a if d == b else d
        if op == aten.permute.default:
            perm = [k % len(x.shape) for k in node.template[0][1]]
            return None if d is None else perm.index(d)
        if op in (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                  aten.squeeze.default):
            return None if d is None else _keep_size(x.shape, node.shape, d)
        if op in _REDUCTIONS:
            dims = _reduced_dims(node)
            if d is None or d in dims:
                return None
            keep = len(node.template[0]) > 2 and node.template[0][2]
            return d if keep else d - sum(1 for r in dims if r < d)
        if op in (aten.mm.default, aten.bmm.default):
            return 0 if d == 0 else None
        if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
            for i in node.inputs:
                di = self._of(i)
                if di is not None and len(i.shape) <= len(node.shape):
                    out = di + len(node.shape) - len(i.shape)
                    if node.shape[out] == i.shape[di]:
                        return out
            return None
        return self._leading(node.inputs, node.shape)

    def _leading(self, inputs, shape):
        """Most ops that keep the leading dimension's size keep it as the batch."""
        for i in inputs:
            if self._of(i) == 0 and len(shape) and shape[0] == i.shape[0]:
                return 0
        return None

    def _from_sharding(self, sharding, ndim):
        spec = getattr(sharding, "spec", None)
        if spec is None:
            return None
        for d, entry in enumerate(tuple(spec)[:ndim]):
            entry = (entry,) if isinstance(entry, str) else tuple(entry or ())
            if entry[:len(self.axes)] == self.axes:
                return d
        return None


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten._reshape_alias.default}


def _sources(node):
    if node.op is ir.OUTPUT and node.inputs[0].op in BARRIERS:
        return (node.inputs[0].inputs[node.template],)
    if node.op is ir.OUTPUT:
        return node.inputs[0].inputs
    return node.inputs


def _reshaped(in_shape, out_shape, d, n):
    """Where dimension ``d``'s ``n`` blocks land after a reshape, if on one dimension."""
    before = math.prod(in_shape[:d])
    for j in range(len(out_shape)):
        if math.prod(out_shape[:j]) == before and out_shape[j] % n == 0 and in_shape[d] % n == 0 \
                and (out_shape[j] % in_shape[d] == 0 or in_shape[d] % out_shape[j] == 0):
            return j
    return None


def _keep_size(in_shape, out_shape, d):
    """The output dimension that is input dimension ``d`` after adding or removing size-1 ones."""
    before = sum(1 for k in range(d) if in_shape[k] != 1)
    seen = 0
    for j, size in enumerate(out_shape):
        if size != 1:
            if seen == before:
                return j if size == in_shape[d] else None
            seen += 1
    return None


def _first_row(value: ir.Node, n: int) -> ir.Node:
    return ir.Node(ir.FIRST_ROW, (value,), ((ir.slot(0), n), ()), (n, *value.shape), value.dtype)


def device_count(mesh, axes) -> int:
    """How many blocks the data axes ``axes`` of ``mesh`` split a batch into."""
    return math.prod(mesh.shape()[a] for a in axes)
