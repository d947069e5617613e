"""The HLO of pending work, before and after XLA's passes.

Example:
    >>> y = (x @ w).relu()
    >>> print(xshard.debug.hlo_text([y]))            # doctest: +SKIP
    >>> print(xshard.debug.compiled_hlo_text([y]))   # collectives inserted by the partitioner
"""

from __future__ import annotations

from xshard.core import compiler
from xshard.core.graph import Graph
from xshard.core.tensor import XTensor


def _graph(tensors) -> Graph:
    if isinstance(tensors, XTensor):
        tensors = [tensors]
    nodes = []
    for t in tensors:
        if not isinstance(t, XTensor):
            raise TypeError(f"expected xshard tensors, got {type(t).__name__}; move it with "
                            f".to(xshard.device()) first")
        nodes.append(t._value())
    return Graph(nodes)


def hlo_text(tensors) -> str:
    """HLO text of the graph computing ``tensors`` as handed to XLA (with sharding attributes)."""
    return compiler.lower(_graph(tensors)).as_text(dialect="hlo")


def stablehlo_text(tensors) -> str:
    """The same program in StableHLO (with Shardy sharding attributes)."""
    return compiler.lower(_graph(tensors)).as_text()


def compiled_hlo_text(tensors) -> str:
    """HLO text after XLA's passes, SPMD partitioning included (the collectives are visible)."""
    return compiler.compile_graph(_graph(tensors)).as_text()


def memory_analysis(tensors):
    """XLA's compiled memory statistics for the graph computing ``tensors`` (per device)."""
    return compiler.compile_graph(_graph(tensors)).memory_analysis()
