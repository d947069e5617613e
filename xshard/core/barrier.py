"""Optimisation barriers: values XLA may not move computation across, nor merge with their twins.

``optimization_barrier(tensors)`` returns the same values; XLA must compute all of them before anything
that uses the outputs, and cannot common up computation on one side with computation on the other.
FSDP uses it to keep each unit's parameter gathers where the unit runs, and activation checkpointing to
stop XLA from reusing forward results instead of recomputing them.
"""

from __future__ import annotations

from xshard.core import ir, runtime
from xshard.core import tensor as xt
from xshard.core.lowering import RULES
from xshard.core.tensor import XTensor

BARRIER = "xshard.optimization_barrier"


def _barrier_rule(*values):
    return tuple(runtime.jax_module().lax.optimization_barrier(tuple(values)))


RULES[BARRIER] = _barrier_rule


def _barrier_node(tensors) -> ir.Node:
    for t in tensors:
        if not isinstance(t, XTensor):
            raise TypeError(f"optimization_barrier takes xshard tensors, got {type(t).__name__} "
                            f"on {getattr(t, 'device', None)}")
    values = tuple(t._value() for t in tensors)
    slots = tuple(ir.Slot(i) for i in range(len(values)))
    return ir.Node(BARRIER, values, (slots, ()), outputs=tuple((v.shape, v.dtype) for v in values))


def optimization_barrier(tensors) -> list:
    """New tensors with the values of ``tensors``, behind one barrier (no autograd history)."""
    tensors = list(tensors)
    if not tensors:
        return []
    node = _barrier_node(tensors)
    return [xt.new_base(ir.output_node(node, i)) for i in range(len(tensors))]


def optimization_barrier_(tensors) -> None:
    """In place: each tensor of ``tensors`` now holds its value behind one shared barrier."""
    tensors = list(tensors)
    if not tensors:
        return
    node = _barrier_node(tensors)
    for i, t in enumerate(tensors):
        t._assign(ir.output_node(node, i))
