"""Optimisation barriers: values XLA may not move computation across, nor merge with their twins.

``optimization_barrier(tensors)`` returns the same values; XLA must compute all of them before anything
that uses the outputs, and cannot common up computation on one side with computation on the other.
FSDP uses it to keep each unit's parameter gathers where the unit runs, and activation checkpointing to
stop XLA from reusing forward results instead of recomputing them.
"""

from __future__ import annotations

import torch

from xshard.core import ir, runtime
from xshard.core.tensor import XTensor, new_base

BARRIER, CSE_BARRIER, BARRIERS = ir.BARRIER, ir.CSE_BARRIER, ir.BARRIERS


def _barrier_node(tensors, op: str = BARRIER) -> ir.Node:
    for t in tensors:
        if not isinstance(t, XTensor):
            raise TypeError(f"optimization_barrier takes xshard tensors, got {type(t).__name__} "
                            f"on {getattr(t, 'device', None)}")
    values = tuple(t._value() for t in tensors)
    slots = tuple(ir.slot(i) for i in range(len(values)))
    return ir.Node(op, values, (slots, ()), outputs=tuple((v.shape, v.dtype) for v in values))


def optimization_barrier(tensors, *, program_order: bool = True) -> list:
    """New tensors with the values of ``tensors``, behind one barrier (no autograd history).

    ``program_order=False``: the caller orders the computation by data (``ordered_after``) and
    needs the barrier only to keep XLA from merging computation across it; on XLA's CPU backend
    the graph then keeps its default scheduler (see [Note: barriers on the CPU backend]).
    """
    tensors = list(tensors)
    if not tensors:
        return []
    node = _barrier_node(tensors, BARRIER if program_order else CSE_BARRIER)
    return [new_base(ir.output_node(node, i)) for i in range(len(tensors))]


_ZERO = 0.0


def ordered_after(tensors, after) -> list:
    """``tensors``, from which XLA computes nothing before every tensor of ``after`` exists.

    Elsewhere one barrier holds both. XLA's CPU pipeline drops barriers before it schedules (see
    above), and a graph with one gets the memory-optimised scheduler, so there the order is a data
    dependency instead: each floating-point tensor gets ``0 * s`` added, where ``s`` is a tensor of
    ``after`` of the same shape (elementwise: laid out alike, no communication), else one element
    of one, and the 0 a runtime input (Python scalars are graph inputs) that XLA cannot fold away.
    Adding a zero leaves every value as it was (NaN and inf in ``s`` are replaced first).
    """
    tensors, after = list(tensors), list(after)
    if runtime.platform() != "cpu":
        return optimization_barrier(tensors + after)[:len(tensors)]
    after = [a for a in after if a.numel() and a.is_floating_point()] or \
        [a for a in after if a.numel()]
    if not after:
        return tensors
    # One element, read once per dtype: when ``after`` is sharded, reading it is a (scalar)
    # collective.
    element_zeros: dict = {}

    def zero_like(t):
        source = next((a for a in after if a.shape == t.shape), None)
        if source is None:
            if t.dtype not in element_zeros:
                element_zeros[t.dtype] = _zero_of(after[0].reshape(-1)[0], t.dtype)
            return element_zeros[t.dtype]
        return _zero_of(source, t.dtype)

    return [t + zero_like(t) if t.is_floating_point() else t for t in tensors]


def _zero_of(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.nan_to_num(source.to(dtype), 0.0, 0.0, 0.0) * _ZERO


def optimization_barrier_(tensors) -> None:
    """In place: each tensor of ``tensors`` now holds its value behind one shared barrier."""
    tensors = list(tensors)
    if not tensors:
        return
    node = _barrier_node(tensors)
    for i, t in enumerate(tensors):
        t._assign(ir.output_node(node, i))
