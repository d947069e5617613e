"""Execution: running pending work, reading values, and where data lives.

``sync()`` gathers every pending cell into one graph, gets its executable (compiled once, then
reused) and dispatches it. JAX's dispatch is asynchronous, so ``sync()`` returns as soon as the work
is queued; the cells then hold ``jax.Array`` results still in flight, and reading one waits.
"""

from __future__ import annotations

import numpy as np
import torch

from xshard.core import arrays, capture, compiler, divergence, ir, runtime, trace
from xshard.core.cells import live_cells, pending_cells, settled, stored
from xshard.core.compiler import input_values
from xshard.core.dtypes import numpy_to_torch, to_numpy_dtype, torch_to_numpy
from xshard.core.graph import Graph
from xshard.core.padding import crop_host
from xshard.core.placement import canonical, default_sharding

jax = runtime.jax_module()


# -- placement (see xshard.core.placement) ---------------------------------------------------------


def upload_node(t: torch.Tensor, sharding=None) -> ir.Node:
    """Copies CPU tensor ``t`` to the devices (asynchronously) and returns its data node.

    Under ``compile_only()`` a meta tensor becomes a data node without data (see there).
    """
    sharding = sharding or default_sharding()
    if t.device.type == "meta":
        if not _COMPILE_ONLY["on"]:
            raise RuntimeError(
                "Cannot copy a meta tensor to the xshard device: it has no data. Materialise it "
                "first, or build the program inside xshard.compile_only() to study it without "
                "data (compile and analyse only).")
        aval = jax.ShapeDtypeStruct(tuple(t.shape), to_numpy_dtype(t.dtype), sharding=sharding)
        return ir.data_node(aval, tuple(t.shape), t.dtype, sharding)
    # A private copy: JAX reads (CPU: may even keep) the host buffer after device_put returns, so
    # a later in-place write to the CPU tensor would otherwise change the device value.
    with trace.phase(trace.TO_DEVICE):
        array = arrays.put(np.array(torch_to_numpy(t), copy=True), sharding)  # no hidden collective
    return ir.data_node(array, tuple(t.shape), t.dtype, array.sharding)


def _placed(array):
    """A result laid out as unannotated data is kept (see ``placement.canonical``)."""
    return canonical(array)


# -- compile-only mode -----------------------------------------------------------------------------

# [Note: compile-only mode]
# Inside compile_only(), meta tensors moved to the device become data nodes whose payload is a
# jax.ShapeDtypeStruct (shape, dtype, sharding) instead of an array. Programs over them trace, lower
# and compile as usual, so XLA's memory and cost analyses are available for meshes and models larger
# than the machine (e.g. 256 virtual devices, billions of parameters), but nothing can run: a sync or a
# read over such inputs raises, except ``sync(abstract=True)``, which stands in for one.
_COMPILE_ONLY = {"on": False}


class CompileOnlyError(RuntimeError):
    pass


class compile_only:
    """Context manager: meta tensors become data-free device tensors (compile and analyse only).

    Example:
        >>> with xshard.compile_only():
        ...     with torch.device("meta"):
        ...         model = GPT(cfg)
        ...     model = FSDP(model)                 # parameters without data, sharded
        ...     loss = model(x, y); loss.backward(); opt.step()
        ...     stats = xshard.memory.analyze_step()   # compiled, never run
    """

    def __enter__(self):
        self._previous = _COMPILE_ONLY["on"]
        _COMPILE_ONLY["on"] = True
        return self

    def __exit__(self, *exc):
        _COMPILE_ONLY["on"] = self._previous
        return False


def compiling_only() -> bool:
    """Whether a ``compile_only()`` block is open."""
    return _COMPILE_ONLY["on"]


def runnable(graph: Graph) -> bool:
    """Whether every input of ``graph`` has data (none comes from ``compile_only()``)."""
    return not any(n.op is ir.DATA and isinstance(n.payload, jax.ShapeDtypeStruct)
                   for n in graph.inputs)


def _check_runnable(graph: Graph) -> None:
    if not runnable(graph):
        raise CompileOnlyError(
            "This graph reads tensors created under xshard.compile_only(), which have no data: "
            "it can be compiled and analysed (xshard.memory.analyze_step()), not run. Drop "
            "those tensors (del, or leave the compile_only block) before syncing real work.")


# -- the pending step ------------------------------------------------------------------------------


class PendingStep:
    """What a sync would run now: the pending cells, their graph, which output each gets, and
    which inputs it may donate."""

    __slots__ = ("cells", "owners", "graph", "donate")

    def __init__(self):
        pending = pending_cells()
        # Cells replacing device data first (see [Note: inputs in the order of the outputs that
        # replace them] in xshard.core.graph); sorted stably, so in creation order otherwise.
        self.cells = sorted((c for c in pending if not c.value.manual and c.error is None),
                            key=_replaces_nothing)
        left_out = [c for c in pending if c.value.manual or c.error is not None]
        outputs, self.owners = result_nodes([(c.value, c.sharding) for c in self.cells])
        self.graph = Graph(outputs, first=[c.source for c in self.cells if c.source is not None])
        self.donate = _donatable(self.graph, left_out)


def _replaces_nothing(cell) -> bool:
    return cell.source is None


def result_nodes(values) -> tuple[list, list]:
    """What a graph computes to store each ``(pending value, annotation)`` pair as a sync stores a
    cell's value (see ``_output``), deduplicated: the output nodes, and per pair the position of
    its output. xshard.step builds a compiled step's outputs with it."""
    outputs, seen, owners = [], {}, []
    for value, annotation in values:
        key = (id(value), annotation)
        if key not in seen:
            seen[key] = len(outputs)
            outputs.append(_output(value, annotation))
        owners.append(seen[key])
    return outputs, owners


def _output(value: ir.Node, annotation) -> ir.Node:
    """The node a sync computes for a cell holding pending ``value`` under ``annotation``."""
    if value.op is ir.PARTIAL_SUM:  # the rows stay as they are (see [Note: per-device partial sums])
        return ir.constrain(value.inputs[0], value.template[0][1])
    if annotation is None:
        return value
    padded = tuple(annotation.padded_shape(value.shape))
    return ir.shard_output(value, padded, annotation.jax_sharding)


def _donatable(graph: Graph, left_out) -> tuple:
    """Inputs whose buffers a sync may give to XLA: data no live cell holds, that no pending value
    left out of this sync reads (a quarantined cell's, or one of an open manual region)."""
    if any(c.value.manual for c in left_out):
        return ()  # an open region's values may read any input
    protected = _data_reachable([c.value for c in left_out]) if left_out else set()
    return tuple(i for i, n in enumerate(graph.inputs)
                 if n.op is ir.DATA and n.holders == 0 and id(n) not in protected
                 and not isinstance(n.payload, jax.ShapeDtypeStruct))


def _data_reachable(values) -> set:
    seen, found, stack = set(), set(), list(values)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op is ir.DATA:
            found.add(id(node))
        stack.extend(node.inputs)
    return found


def pending_step() -> PendingStep:
    return PendingStep()


# -- running ---------------------------------------------------------------------------------------


def sync(wait: bool = False, abstract: bool = False) -> int:
    """Compiles (or reuses) and dispatches one graph computing every pending live tensor; returns
    how many storages it computed.

    ``abstract=True`` (under ``compile_only()``): runs nothing; every pending value becomes data
    without data (a ``jax.ShapeDtypeStruct``) laid out as its tensor's annotation says, or
    replicated when it has none, as a real step would leave it (see xshard.memory.abstract_sync).

    Inside a capture (xshard.core.capture: a step being recorded by ``xshard.compile``) it does
    nothing: the whole step becomes one graph.
    """
    if capture.skips_sync():
        return 0
    return _sync(wait, abstract)


@trace.phased(trace.SYNC)
@divergence.retry_after_gc
def _sync(wait: bool, abstract: bool) -> int:
    with trace.phase(trace.BUILD_GRAPH):
        step = PendingStep()
    if not step.cells:
        divergence.nothing_to_run()
        if wait:
            wait_all()
        return 0
    graph = step.graph
    if abstract:
        results = _abstract_results(step)
    else:
        _check_runnable(graph)
        try:
            exe = compiler.executable(graph, step.donate)
        except Exception as error:
            _quarantine(step.cells, error)
            raise
        divergence.before_run(exe, graph)  # multi-process: every process runs this same program
        results = _run(exe, graph, step.donate)
    nodes = {}
    for c, pos in zip(step.cells, step.owners):
        node = nodes.get(pos)
        if node is None:
            array = results[pos] if abstract else _placed(results[pos])
            value = stored(c.value)
            node = nodes[pos] = ir.data_node(array, value.shape, value.dtype, array.sharding)
        if c.value.op is ir.PARTIAL_SUM:
            c.write(ir.partial_sum(node, c.value.template[0][1]))
        else:
            c.write(node)
    if wait:
        wait_all()
    return len(step.cells)


def _run(exe, graph: Graph, donatable: tuple) -> list:
    """Runs ``exe`` on ``graph``'s inputs. An input the executable was compiled to donate that
    something now holds is passed as a copy: donation never costs a second executable."""
    values = input_values(graph, exe.moves)
    if exe.donate != donatable:
        free = set(donatable)
        for i in exe.donate:
            if i not in free:
                values[i] = jax.device_put(values[i], may_alias=False)
    with trace.phase(trace.EXECUTE):
        results = exe.compiled(*values)
    compiler.dispatched(exe.compiled, results, exe.handles(results))
    return results


def _abstract_results(step: PendingStep) -> list:
    if not _COMPILE_ONLY["on"]:
        raise CompileOnlyError(
            "abstract_sync() stands in for a sync under xshard.compile_only() only; outside it, "
            "run the step with xshard.sync().")
    results = []
    for pos in range(len(step.graph.outputs)):
        c = step.cells[step.owners.index(pos)]
        node = stored(c.value)
        annotation = c.sharding
        if annotation is not None and c.value.op is not ir.PARTIAL_SUM:
            shape, sharding = tuple(annotation.padded_shape(node.shape)), annotation.jax_sharding
        elif c.value.op is ir.PARTIAL_SUM:
            shape, sharding = tuple(node.shape), c.value.template[0][1]
        else:
            shape, sharding = tuple(node.shape), default_sharding()
        results.append(jax.ShapeDtypeStruct(shape, to_numpy_dtype(node.dtype), sharding=sharding))
    return results


def _quarantine(cells, error) -> None:
    """After a graph failed to compile: marks the pending cells whose own graph fails (all of them
    when none fails alone), so later syncs run the rest. Reading a marked tensor raises again."""
    failed = False
    for c in cells:
        try:
            compiler.lower(Graph([c.value]))
        except Exception as e:  # noqa: BLE001  (any lowering error marks the cell)
            c.error = e
            failed = True
    if not failed:
        for c in cells:
            c.error = error


def evaluate(nodes, *, allowed: bool = False) -> list:
    """Computes ``nodes`` without binding the results to any tensor (no donation); ``allowed``:
    an open capture's owner has let this read happen."""
    if not allowed:
        capture.check_read("computing a value before the step ends")
    graph = Graph(list(nodes))
    _check_runnable(graph)
    exe = compiler.executable(graph)
    divergence.before_run(exe, graph, "evaluate")
    return list(_run(exe, graph, ()))


def wait_all() -> None:
    """Blocks until every dispatched computation has finished."""
    compiler.drain()
    for c in live_cells():
        if settled(c.value):
            for array in ir.arrays_of(stored(c.value)):  # a packed node's without cutting it
                if isinstance(array, jax.Array):
                    array.block_until_ready()


def to_cpu(t) -> torch.Tensor:
    """The value of xshard tensor ``t`` as a CPU tensor; runs pending work first (one graph, like
    ``sync()``). A tensor whose step failed raises that step's error."""
    allowed = capture.check_read("reading a tensor's value (.item(), .cpu(), print, bool(), ...)",
                                 t)
    cell = t._cell
    if cell.error is None and not settled(cell.value) and not allowed:
        sync()
    if cell.error is not None:
        raise cell.error
    node = t._value()
    if node.manual:
        raise RuntimeError(
            "This tensor holds per-device shards inside a manual sharding region; close the region "
            "with xshard.spmd.disable_manual_sharding(t, spec, full_shape) to read its value.")
    if 0 in node.shape:  # nothing to read (jax cannot assemble an empty array padded unevenly)
        return torch.empty(node.shape, dtype=node.dtype)
    array = node.payload if node.op is ir.DATA else evaluate([node], allowed=allowed)[0]
    # A collective when no process holds all of it; cropped when padded (an uneven sharding).
    with trace.phase(trace.FROM_DEVICE):
        host = arrays.to_host(array)
    return crop_host(numpy_to_torch(host), node.shape)
