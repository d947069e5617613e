"""Graph linearisation and keys: pending IR nodes in the order a program computes them.

[Note: the graph key]
A graph is linearised in post-order. Each node contributes its exact ``key`` (op, static arguments,
shape, dtype; device data: shape, dtype and sharding; a scalar input: its type; see [Note: exact
keys] in xshard.core.ir) and the positions of its inputs. Together with the output positions this is
the key of the executable cache: a step that differs only in data or in scalar values reuses the
executable. Which inputs are donated is not part of it (see xshard.core.execute).
"""

from __future__ import annotations

from xshard.core import ir


class Graph:
    """A linearised pending graph: nodes in post-order, inputs, outputs and its cache key."""

    __slots__ = ("order", "children", "inputs", "outputs", "key")

    def __init__(self, outputs, boundary=(), first=()):
        # ``boundary``: ops whose nodes count as inputs, their own inputs not followed (the entry
        # points of a manual-sharding region). ``first``: inputs to put first, in this order (see
        # [Note: inputs in the order of the outputs that replace them]).
        order, children, positions = [], [], {}
        inputs, entries = [], []
        for out in outputs:
            if id(out) in positions:
                continue
            # An explicit stack of (node, inputs still to visit): inputs before their users.
            stack = [(out, iter(()) if _leaf(out, boundary) else iter(out.inputs))]
            while stack:
                node, rest = stack[-1]
                for i in rest:
                    if id(i) not in positions:
                        stack.append((i, iter(()) if _leaf(i, boundary) else iter(i.inputs)))
                        break
                else:
                    stack.pop()
                    if id(node) in positions:
                        continue
                    positions[id(node)] = len(order)
                    order.append(node)
                    if _leaf(node, boundary):
                        children.append(())
                        entries.append((node.key, len(inputs)))
                        inputs.append(node)
                    else:
                        kids = tuple([positions[id(i)] for i in node.inputs])
                        children.append(kids)
                        entries.append((node.key, kids))
        if first:
            inputs = _put_first(first, inputs, entries)
        self.order = order
        self.children = children
        self.inputs = inputs
        self.outputs = tuple([positions[id(n)] for n in outputs])
        self.key = (tuple(entries), self.outputs)

    def describe(self):
        """What a recompile log compares: input avals and the op sequence."""
        ins = [(tuple(n.shape), n.dtype, n.sharding) if n.op is ir.DATA else ("scalar", n.dtype)
               for n in self.inputs]
        ops = [str(n.op) for n in self.order if n.op is not ir.DATA and n.op is not ir.SCALAR]
        return ins, ops


# [Note: inputs in the order of the outputs that replace them]
# A program donates the buffers of the state it overwrites, and XLA decides which output reuses
# which donated buffer by size alone: it sorts both lists by size (stably) and pairs them in order.
# A parameter's update paired with another parameter's buffer of the same size makes XLA copy both
# around the update (an input read after its buffer is overwritten): on the GPT+AdamW step, 77 of
# 112 updates were crossed so, 84 copies per step. So a caller lists the data each output replaces,
# in output order, with those outputs first (``first``); those inputs then come first, in that
# order, and every pair XLA makes is an update and the state it replaces.


def _put_first(first, inputs: list, entries: list) -> list:
    """``inputs`` reordered with those in ``first`` leading, in its order; ``entries`` (each
    input's ``(key, position)``) updated in place."""
    at = {id(n): k for k, n in enumerate(inputs)}
    lead = list(dict.fromkeys(at[id(n)] for n in first if id(n) in at))
    if lead == list(range(len(lead))):
        return inputs
    taken = set(lead)
    order = lead + [k for k in range(len(inputs)) if k not in taken]
    new = {old: k for k, old in enumerate(order)}
    for j, (key, ref) in enumerate(entries):
        if type(ref) is int:
            entries[j] = (key, new[ref])
    return [inputs[k] for k in order]


def _leaf(node, boundary) -> bool:
    op = node.op
    return op is ir.DATA or op is ir.SCALAR or (boundary and op in boundary)


# [Note: values computed twice]
# Two nodes compute the same value when they have the same key (op, static arguments, shape, dtype)
# and their inputs are, recursively, the same values: data by identity (one array), scalars by type
# and exact value. Random ops are no exception: a draw's key data comes from the stream's seed and
# counter, two scalars (see xshard.core.rng), so two draws are the same value only when they use the
# same counter, which is what activation checkpointing does to recompute a mask. A compiled step
# stores such values once (xshard.step): AdamW's step count per parameter is one array, written into
# every parameter's count, and the next recording then reads it as one input. Result k of a
# ``_foreach_*`` op (optimizers update their lists of state with them) is computed from element k of
# each tensor list alone, so it is numbered from those elements and the op's other arguments whole.


def same_values(nodes) -> list:
    """Each of ``nodes`` replaced by the first of them that computes the same value (see [Note:
    values computed twice])."""
    numbers: dict = {}  # id(node) -> value number
    interned: dict = {}
    first: dict = {}  # value number -> the first of ``nodes`` with it
    out = []
    for root in nodes:
        stack = [root]
        while stack:
            node = stack[-1]
            if id(node) in numbers:
                stack.pop()
                continue
            todo = [i for i in node.inputs if id(i) not in numbers]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if node.op is ir.DATA:
                local = (ir.DATA, id(node))
            elif node.op is ir.SCALAR:
                local = (node.key, ir.exact(node.payload))
            elif node.op is ir.OUTPUT and _foreach(node.inputs[0].op):
                local = _foreach_result(node, numbers)
            else:
                local = (node.key, tuple([numbers[id(i)] for i in node.inputs]))
            numbers[id(node)] = interned.setdefault(local, len(interned))
        out.append(first.setdefault(numbers[id(root)], root))
    return out


def _foreach(op) -> bool:
    return type(op) is not str and op.__name__.startswith("_foreach_")


def _foreach_result(node, numbers: dict) -> tuple:
    """The value number's form of result ``k`` of a ``_foreach_*`` op (see [Note: values computed
    twice]); it keeps ``k`` when another argument may differ per element (a list of scalars, a
    tensor of per-element scalars)."""
    multi, k = node.inputs[0], node.template
    per_element = False

    def part(x):
        nonlocal per_element
        if type(x) is ir.Slot:
            source = multi.inputs[x.index]
            if len(source.shape) > 0 and source.op is not ir.SCALAR:
                per_element = True
            return ("whole", numbers[id(source)])
        if type(x) is tuple:
            if len(x) == len(multi.outputs) and x and all(type(e) is ir.Slot for e in x):
                return ("item", numbers[id(multi.inputs[x[k].index])])
            if any(isinstance(e, (int, float, complex)) for e in x):
                per_element = True  # a list of scalars
            return tuple([part(e) for e in x])
        return ir.exact(x)

    form = part(multi.template)
    return ("foreach", multi.key, node.shape, node.dtype, form, k if per_element else None)
