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

    def __init__(self, outputs, boundary=()):
        # ``boundary``: ops whose nodes count as inputs, their own inputs not followed (the entry
        # points of a manual-sharding region).
        order, children, positions = [], [], {}
        inputs, entries = [], []
        stack = [(n, False) for n in reversed(outputs)]
        DATA, SCALAR = ir.DATA, ir.SCALAR
        while stack:
            node, expanded = stack.pop()
            if id(node) in positions:
                continue
            leaf = node.op in boundary
            if not expanded and node.inputs and not leaf:
                stack.append((node, True))
                stack.extend((i, False) for i in reversed(node.inputs) if id(i) not in positions)
                continue
            positions[id(node)] = len(order)
            order.append(node)
            if leaf or node.op is DATA or node.op is SCALAR:
                children.append(())
                inputs.append(node)
                entries.append((node.key, len(inputs) - 1))
            else:
                kids = tuple([positions[id(i)] for i in node.inputs])
                children.append(kids)
                entries.append((node.key, kids))
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
