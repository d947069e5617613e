"""Compilation and the executable cache: a linearised graph becomes one ``jax.jit`` program.

``Program`` interprets a graph's nodes with the lowering table while JAX traces it; ``executable``
looks a graph up by its key (see [Note: the graph key] in xshard.core.graph) and, on a miss, lowers
and compiles it (``jax.jit(...).lower(...).compile()``: XLA propagates shardings and partitions the
program here) with the XLA options its ops ask for.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import warnings

import numpy as np

from xshard.core import divergence, ir, placement, runtime, trace
from xshard.core.dtypes import to_numpy_dtype
from xshard.core.graph import Graph
from xshard.core.lowering import RULES, LoweringError, apply_rule, table
from xshard.core.padding import crop_array

jax = runtime.jax_module()

log = logging.getLogger("xshard")


class Program:
    """The payload-free description of a graph that the traced function interprets."""

    def __init__(self, graph: Graph):
        self.steps = []
        position = {id(n): i for i, n in enumerate(graph.inputs)}
        for node, kids in zip(graph.order, graph.children):
            if node.op is ir.DATA or (not kids and node.inputs):
                self.steps.append(("data", position[id(node)], tuple(node.shape)))
            elif node.op is ir.SCALAR:
                self.steps.append(("scalar", position[id(node)], node.template == "weak"))
            elif node.op is ir.OUTPUT:
                self.steps.append(("output", kids[0], node.template))
            else:
                rule = RULES.get(node.op)
                if rule is None:
                    raise LoweringError(f"no lowering rule for {node.op}")
                self.steps.append(("op", kids, (node.op, rule, node.template, node.shape,
                                                node.dtype, node.outputs)))
        self.outputs = graph.outputs
        self.replicated = placement.replicated_sharding(graph)  # for lowering.table.combine

    def __call__(self, *inputs):
        table.PROGRAM["replicated"] = self.replicated
        try:
            return self._trace(inputs)
        finally:
            table.PROGRAM["replicated"] = None

    def _trace(self, inputs):
        vals = []
        for kind, a, b in self.steps:
            if kind == "op":
                op, rule, template, shape, dtype, outputs = b
                vals.append(apply_rule(op, rule, template, [vals[k] for k in a], shape, dtype,
                                       outputs))
            elif kind == "data":
                # Padded device data (an uneven sharding): the logical value is the leading block.
                vals.append(crop_array(inputs[a], b))
            elif kind == "scalar":
                x = inputs[a]
                vals.append(table.weak_typed(x) if b else x)
            else:
                vals.append(vals[a][b])
        return tuple(vals[o] for o in self.outputs)


def input_values(graph: Graph, moves=None) -> list:
    """The arguments of ``graph``'s program: each input's payload (scalars as 0-d numpy arrays),
    placed so that jit accepts them together by the ``moves`` of the graph's placement plan (made
    here when not given; see [Note: one device assignment per graph] in xshard.core.placement)."""
    values = []
    for node in graph.inputs:
        if node.op is ir.SCALAR:
            values.append(np.asarray(node.payload, to_numpy_dtype(node.dtype)))
        else:
            values.append(node.payload)
    if moves is None:
        moves = placement.plan(graph)
    return placement.colocate(graph.inputs, values, moves) if moves else values


def lower(graph: Graph, values=None, donate=()):
    """``graph`` traced and lowered to StableHLO (a ``jax.stages.Lowered``)."""
    program = Program(graph)
    program.__name__ = trace.program_name()  # see [Note: executable names] in xshard.core.trace
    jitted = jax.jit(program, donate_argnums=donate)
    with warnings.catch_warnings():
        # Donation is offered for every buffer no live tensor holds; XLA reuses those it can.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return jitted.lower(*(input_values(graph) if values is None else values))


# [Note: barriers on the CPU backend]
# XLA's CPU pipeline removes optimisation barriers before it schedules (the pass is named
# ``cse_barrier_expander``: there a barrier only stops CSE), and its default concurrency-optimised
# scheduler then starts every collective as early as its operands allow, so FSDP's all-gathers all
# run at the start of the program, every unit's full parameters alive at once; the all-reduce
# combiner also merges every gradient reduction (CPU reduces a gradient with an all-reduce and a
# slice) into one at the end of backward, holding every full gradient. Measured on 8 virtual CPU
# devices, 8 units of 2 MiB each: 32 MiB of temporaries per device with both, 2 MiB without.
# A graph with a BARRIER asks for program order to hold, so it is compiled with the memory-minimising
# scheduler (the XLA_FLAGS equivalent: --xla_cpu_enable_concurrency_optimized_scheduler=false) and
# without that combiner. That scheduler keeps program order, which FSDP's gathers need, but it holds
# more activations than the default one (a 6-block MLP's backward: 48 MiB of temporaries against
# 28 MiB), so code that only needs one value computed after another uses ``ordered_after``
# (xshard.core.barrier). The last CSE pass also runs after barriers are gone: activation
# checkpointing defends against it itself (see xshard/fsdp/utils.py).
# A graph whose code carries its order in data dependencies and needs a barrier only against CSE
# uses CSE_BARRIER: it keeps the default scheduler, which frees recomputed activations far better
# (FSDP with activation checkpointing, see [Note: FSDP gathers ordered by data]), and only loses
# the combiner.
def _barrier_options() -> dict:
    if runtime.platform() != "cpu":
        return {}
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
            "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def _cse_barrier_options() -> dict:
    if runtime.platform() != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


# Compiler options a graph needs because it contains some op: op -> function returning XLA options.
_OP_OPTIONS = {ir.BARRIER: _barrier_options, ir.CSE_BARRIER: _cse_barrier_options}


# [Note: scatters on the CPU backend]
# XLA's CPU pipeline expands every scatter into a loop of dynamic-slice / dynamic-update-slice,
# which leans on their clamping: an update whose index is out of bounds reads the clamped element
# and writes it back unchanged. The SPMD partitioner shifts a scatter's indices by each device's
# offset, so on most devices the index is out of bounds by design. When the operand is itself a
# dynamic slice (an array resharded from replicated inside the program, or cropped to an uneven
# size) and the scatter has one update (``x[1] += 1``, a write through a view), the loop is
# unrolled and the algebraic simplifier folds the two dynamic slices into one without clamping the
# inner index: the loop reads another element and writes it where the clamped index points, so
# every other device overwrites its first element (jaxlib 0.10.2; tests/spmd/test_scatter.py
# has the cases, checked against eager, which also fail in plain JAX). Without the expander XLA's
# CPU backend emits the scatter natively, skipping out-of-bounds updates as the scatter semantics
# say, and as fast or faster (an embedding's backward, 1024 updates of 128: 0.45 against 0.58 ms).
_CPU_OPTIONS = {"xla_disable_hlo_passes": "scatter_expander"}


# [Note: no excess precision]
# XLA may skip the rounding of a 16-bit intermediate it computes in float32 anyway (its default,
# ``xla_allow_excess_precision``): a bfloat16 matrix product followed by ``* 3.3`` in one program
# then rounds once where eager rounds the product first, and the two differ in the last place
# (which Muon's bfloat16 Newton-Schulz iterations grew to 6% of its update). The lowering rules
# already round where ATen's kernels do, so xshard compiles every program with that rounding
# kept: 16-bit programs then equal eager's bit for bit where their rules do. Float32 programs
# are unaffected.
_OPTIONS = {"xla_allow_excess_precision": False}


def compiler_options(graph: Graph) -> dict:
    """The XLA options for compiling ``graph``: every program's (see [Note: no excess
    precision]), the backend's (see [Note: scatters on the CPU backend]) and those its ops ask for
    (lists of passes to disable are merged)."""
    options = dict(_OPTIONS, **(_CPU_OPTIONS if runtime.platform() == "cpu" else {}))
    ops = {node.op for node in graph.order if type(node.op) is str}
    for op in sorted(ops & _OP_OPTIONS.keys()):
        for key, value in _OP_OPTIONS[op]().items():
            if key == "xla_disable_hlo_passes" and key in options:
                value = ",".join(dict.fromkeys(options[key].split(",") + value.split(",")))
            options[key] = value
    return options


def compile_graph(graph: Graph, lowered=None, donate=()):
    """Compiles ``graph`` (lowered already, or lowered here) with the options its ops need."""
    if lowered is None:
        lowered = lower(graph, donate=donate)
    return compile_lowered(lowered, compiler_options(graph))


def compile_lowered(lowered, options: dict):
    """Compiles ``lowered`` with XLA ``options`` (see ``compiler_options``)."""
    if options:
        try:
            return lowered.compile(options)
        except jax.errors.JaxRuntimeError as e:
            if "option" not in str(e):
                raise
            # An XLA that does not know one of these options: compile as it would by default.
            warnings.warn(f"xshard: compiling without {sorted(options)}: {e}", stacklevel=2)
    return lowered.compile()


class Executable:
    """A compiled graph, the inputs it donates, how its inputs are placed, and what a recompile
    log compares."""

    __slots__ = ("compiled", "donate", "describe", "digest", "moves", "handle")

    def __init__(self, compiled, donate: tuple, describe, digest=None, moves=()):
        self.compiled = compiled
        self.donate = donate
        self.describe = describe
        self.digest = digest  # of the lowered program, compared across processes (divergence.py)
        self.moves = moves  # the graph's placement plan (see xshard.core.placement)
        self.handle = None  # see [Note: a bounded dispatch queue]; set by the first handles()

    def handles(self, results) -> tuple:
        """Which of this executable's results bound the executions in flight (the same every call:
        taken from the first call's results)."""
        if self.handle is None:
            self.handle = small_results([(i, (a.shape, a.dtype)) for i, a in enumerate(results)])
        return self.handle


# [Note: a bounded dispatch queue]
# JAX dispatches executions asynchronously, so a loop that reads no value (a training loop logging
# every 100 steps) runs ahead of the devices without bound. XLA's CPU client does not survive that:
# with about 100 steps of an 8-device program in flight its in-process collectives stop meeting (a
# rendezvous waits 20 s, then aborts the process), in pure JAX as well (jax 0.10.2, 8 virtual CPU
# devices; blocking every 10 steps avoids it). So each execution leaves handles, its scalar results
# (a loss, typically), and dispatching one more than ``MAX_IN_FLIGHT`` first waits for the oldest.
# Eight steps ahead is ample overlap of host and devices on any platform. A handle a later execution
# consumed (donated) is skipped: that execution is in the queue too. A program without small results
# leaves none (holding large ones would keep memory alive). The compiled step chooses its own handles
# (its returned tensors): a reference to state it donates would make it copy that state instead.
MAX_IN_FLIGHT = 8
_HANDLE_BYTES = 64
_in_flight: collections.deque = collections.deque()


def small_results(results) -> tuple:
    """Of ``(position, (shape, dtype))`` pairs, the positions of results of at most
    ``_HANDLE_BYTES`` (at most 4): the handles of [Note: a bounded dispatch queue]."""
    return tuple(p for p, (shape, dtype) in results
                 if math.prod(shape) * dtype.itemsize <= _HANDLE_BYTES)[:4]


# Lists that ``watching()`` hands out: each gets the compiled executable of every execution.
_watchers: list = []


@contextlib.contextmanager
def watching():
    """Yields a list that gets the compiled executable (``jax.stages.Compiled``) of each execution
    dispatched inside the block, lazy syncs and compiled steps alike (``memory.measure_step``
    reads their FLOPs)."""
    runs: list = []
    _watchers.append(runs)
    try:
        yield runs
    finally:
        _watchers.remove(runs)


def dispatched(compiled, results, handles: tuple) -> None:
    """Called right after ``compiled`` returned ``results``: keeps ``results[p]`` for ``p`` in
    ``handles``, and waits for the oldest execution once more than ``MAX_IN_FLIGHT`` are kept (see
    [Note: a bounded dispatch queue])."""
    for runs in _watchers:
        runs.append(compiled)
    if not handles:
        return
    _in_flight.append(tuple(results[p] for p in handles))
    while len(_in_flight) > MAX_IN_FLIGHT:
        _wait(_in_flight.popleft())


def _wait(arrays) -> None:
    for array in arrays:
        if not array.is_deleted():
            try:
                array.block_until_ready()
            except jax.errors.JaxRuntimeError:
                pass  # that execution's error is raised where its values are read
            return


def drain() -> None:
    """Waits for every execution in the queue, and lets its handles go."""
    while _in_flight:
        _wait(_in_flight.popleft())


# Graph key -> Executable, least recently used first; at most runtime.cache_limit() entries.
_CACHE: collections.OrderedDict = collections.OrderedDict()


def executable(graph: Graph, donate: tuple = ()) -> Executable:
    """The executable of ``graph``, compiled on the first request; ``donate`` (input positions
    whose buffers nothing else holds) applies to that compilation only."""
    exe = _CACHE.get(graph.key)
    if exe is not None:
        _CACHE.move_to_end(graph.key)
        trace.cache_hit(graph, exe)
        return exe
    cause = _log_recompile(graph)
    with trace.phase(trace.COMPILE):
        moves = placement.plan(graph)  # a function of the key: made once per executable
        lowered = lower(graph, input_values(graph, moves), donate)
        compiled = compile_graph(graph, lowered)
    exe = _CACHE[graph.key] = Executable(compiled, tuple(donate), graph.describe(),
                                         divergence.lowered_digest(lowered), moves)
    limit = runtime.cache_limit()
    while limit is not None and len(_CACHE) > limit:
        _CACHE.popitem(last=False)  # compiled again if it is needed again
    trace.compiled(graph, exe, cause)
    return exe


def clear_cache() -> None:
    _CACHE.clear()


def cache_size() -> int:
    """How many executables the cache holds (programs compiled by this process)."""
    return len(_CACHE)


def _log_recompile(graph: Graph):
    """What differs between ``graph`` and the nearest cached graph (logged at DEBUG level, and
    returned for XSHARD_DEBUG's report), or None."""
    if not _CACHE or not (log.isEnabledFor(logging.DEBUG) or trace.DEBUG):
        return None
    ins, ops = graph.describe()
    best, best_score = None, None
    for exe in _CACHE.values():
        cins, cops = exe.describe
        score = abs(len(cins) - len(ins)) + abs(len(cops) - len(ops)) + sum(
            a != b for a, b in zip(cins, ins)) + sum(a != b for a, b in zip(cops, ops))
        if best_score is None or score < best_score:
            best, best_score = exe.describe, score
    cins, cops = best
    reasons = []
    for i, (a, b) in enumerate(zip(cins, ins)):
        if a != b:
            what = ("shape" if a[0] != b[0] else "dtype" if a[1] != b[1] else "sharding")
            reasons.append(f"input {i} {what}: {a[:2] if what != 'sharding' else a[2]} -> "
                           f"{b[:2] if what != 'sharding' else b[2]}")
            break
    if len(cins) != len(ins):
        reasons.append(f"number of inputs {len(cins)} -> {len(ins)}")
    for i, (a, b) in enumerate(zip(cops, ops)):
        if a != b:
            reasons.append(f"op {i}: {a} -> {b}")
            break
    if len(cops) != len(ops):
        reasons.append(f"number of ops {len(cops)} -> {len(ops)}")
    cause = "; ".join(reasons) or "static op arguments"
    log.debug("xshard recompiles a graph of %d ops; nearest cached graph differs in: %s",
              len(ops), cause)
    return cause
