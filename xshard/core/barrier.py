"""Optimisation barriers: values XLA may not move computation across, nor merge with their twins.

``optimization_barrier(tensors)`` returns the same values; XLA must compute all of them before anything
that uses the outputs, and cannot common up computation on one side with computation on the other.
FSDP uses it to keep each unit's parameter gathers where the unit runs, and activation checkpointing to
stop XLA from reusing forward results instead of recomputing them.
"""

from __future__ import annotations

import torch

from xshard.core import graph, ir, runtime
from xshard.core import tensor as xt
from xshard.core.lowering import RULES
from xshard.core.tensor import XTensor

BARRIER = "xshard.optimization_barrier"
# The same barrier for users that order their computation by data dependencies themselves
# (``ordered_after``): it stops CSE but asks for no program order (see the note below).
CSE_BARRIER = "xshard.cse_barrier"
BARRIERS = (BARRIER, CSE_BARRIER)


def _barrier_rule(*values):
    return tuple(runtime.jax_module().lax.optimization_barrier(tuple(values)))


RULES[BARRIER] = RULES[CSE_BARRIER] = _barrier_rule


# [Note: barriers on the CPU backend]
# XLA's CPU pipeline removes optimisation barriers before it schedules (the pass is named
# ``cse_barrier_expander``: there a barrier only stops CSE), and its default concurrency-optimised
# scheduler then starts every collective as early as its operands allow, so FSDP's all-gathers all
# run at the start of the program, every unit's full parameters alive at once; the all-reduce
# combiner also merges every gradient reduction (CPU reduces a gradient with an all-reduce and a
# slice) into one at the end of backward, holding every full gradient. Measured on 8 virtual CPU
# devices, 8 units of 2 MiB each: 32 MiB of temporaries per device with both, 2 MiB without.
# A graph with a barrier asks for program order to hold, so it is compiled with the memory-minimising
# scheduler (the XLA_FLAGS equivalent: --xla_cpu_enable_concurrency_optimized_scheduler=false) and
# without that combiner. That scheduler keeps program order, which FSDP's gathers need, but it holds
# more activations than the default one (a 6-block MLP's backward: 48 MiB of temporaries against
# 28 MiB), so code that only needs one value computed after another uses ``ordered_after``. The
# last CSE pass also runs after barriers are gone: activation checkpointing defends against it
# itself (see xshard/fsdp/utils.py).
# Code that carries its order in data dependencies (``ordered_after``) and needs a barrier only
# against CSE uses ``program_order=False``: such a graph keeps the default scheduler, which frees
# recomputed activations far better (FSDP with activation checkpointing, see
# [Note: FSDP gathers ordered by data]), and only loses the combiner.
def _barrier_compiler_options() -> dict:
    if runtime.platform() != "cpu":
        return {}
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
            "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def _cse_barrier_compiler_options() -> dict:
    if runtime.platform() != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


graph.OP_COMPILER_OPTIONS[BARRIER] = _barrier_compiler_options
graph.OP_COMPILER_OPTIONS[CSE_BARRIER] = _cse_barrier_compiler_options


def _barrier_node(tensors, op: str = BARRIER) -> ir.Node:
    for t in tensors:
        if not isinstance(t, XTensor):
            raise TypeError(f"optimization_barrier takes xshard tensors, got {type(t).__name__} "
                            f"on {getattr(t, 'device', None)}")
    values = tuple(t._value() for t in tensors)
    slots = tuple(ir.Slot(i) for i in range(len(values)))
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
    return [xt.new_base(ir.output_node(node, i)) for i in range(len(tensors))]


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
