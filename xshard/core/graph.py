"""From pending IR to results: graph building, the executable cache, compilation and execution.

``sync()`` gathers every live tensor with pending work into one graph, keys it by structure, compiles
it on a cache miss (``jax.jit(...).lower(...).compile()``: XLA propagates shardings and partitions the
program here) and dispatches it. JAX's dispatch is asynchronous, so ``sync()`` returns as soon as the
work is queued; the tensors then hold ``jax.Array`` results still in flight, and reading one waits.

[Note: the graph key]
A graph is linearised in post-order. Each node contributes its exact ``key`` (op, static arguments,
shape, dtype: see [Note: exact keys] in xshard.core.ir) and the positions of its inputs; device data
contributes its aval and sharding; Python scalars their type. Together with the output positions and the donation mask this is the key of
the executable cache: a step that differs only in data or in scalar values reuses the executable.
"""

from __future__ import annotations

import logging
import time
import warnings

import numpy as np
import torch

from xshard.core import ir, metrics, runtime
from xshard.core.dtypes import numpy_to_torch, to_numpy_dtype, torch_to_numpy
from xshard.core.lowering import RULES
from xshard.core.tensor import LIVE_CELLS, XTensor

jax = runtime.jax_module()
from jax._src.lax import lax as _lax_internal  # noqa: E402

log = logging.getLogger("xshard")


class LoweringError(RuntimeError):
    pass


# -- placement -------------------------------------------------------------------------------------

_DEFAULT_SHARDING = None


def default_sharding():
    """Unannotated data is replicated over every device (as in PyTorch/XLA's SPMD mode)."""
    global _DEFAULT_SHARDING
    if _DEFAULT_SHARDING is None:
        devices = runtime.devices()
        if len(devices) == 1:
            _DEFAULT_SHARDING = jax.sharding.SingleDeviceSharding(devices[0])
        else:
            mesh = jax.sharding.Mesh(np.array(devices), ("xshard_all",))
            _DEFAULT_SHARDING = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return _DEFAULT_SHARDING


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
    array = jax.device_put(np.array(torch_to_numpy(t), copy=True), sharding)
    return ir.data_node(array, tuple(t.shape), t.dtype, array.sharding)


# [Note: compile-only mode]
# Inside compile_only(), meta tensors moved to the device become data nodes whose payload is a
# jax.ShapeDtypeStruct (shape, dtype, sharding) instead of an array. Programs over them trace, lower
# and compile as usual, so XLA's memory and cost analyses are available for meshes and models larger
# than the machine (e.g. 256 virtual devices, billions of parameters), but nothing can run: a sync or a
# read over such inputs raises.
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


def _check_runnable(graph: "Graph") -> None:
    for node in graph.inputs:
        if node.op is ir.DATA and isinstance(node.payload, jax.ShapeDtypeStruct):
            raise CompileOnlyError(
                "This graph reads tensors created under xshard.compile_only(), which have no data: "
                "it can be compiled and analysed (xshard.memory.analyze_step()), not run. Drop "
                "those tensors (del, or leave the compile_only block) before syncing real work.")


def to_cpu(t: XTensor) -> torch.Tensor:
    """The value of ``t`` as a CPU tensor; runs pending work first (one graph, like ``sync()``)."""
    if not settled(t._cell.value):
        sync()
    node = t._value()
    if node.manual:
        raise RuntimeError(
            "This tensor holds per-device shards inside a manual sharding region; close the region "
            "with xshard.spmd.disable_manual_sharding(t, spec, full_shape) to read its value.")
    array = node.payload if node.is_data else evaluate([node])[0]
    out = numpy_to_torch(np.asarray(array))
    if tuple(out.shape) != tuple(node.shape):  # padded for an uneven sharding
        out = out[tuple(slice(0, n) for n in node.shape)].clone()
    return out


# -- graphs ----------------------------------------------------------------------------------------


class Graph:
    """A linearised pending graph: nodes in post-order, inputs, outputs and its cache key."""

    __slots__ = ("order", "children", "inputs", "outputs", "key", "donate")

    def __init__(self, outputs, donate_ok=None, boundary=frozenset()):
        # ``boundary``: ops whose nodes count as inputs, their own inputs not followed (the entry
        # points of a manual-sharding region).
        order, children, positions = [], [], {}
        inputs, entries = [], []
        stack = [(n, False) for n in reversed(outputs)]
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
            kids = () if leaf else tuple(positions[id(i)] for i in node.inputs)
            children.append(kids)
            if node.op is ir.DATA or node.op is ir.SCALAR or leaf:
                inputs.append(node)
                entries.append((node.key, len(inputs) - 1))
            else:
                entries.append((node.key, kids))
        self.order = order
        self.children = children
        self.inputs = inputs
        self.outputs = tuple(positions[id(n)] for n in outputs)
        donate = ()
        if donate_ok is not None:
            donate = tuple(i for i, n in enumerate(inputs)
                           if n.op is ir.DATA and donate_ok(n.payload))
        self.donate = donate
        self.key = (tuple(entries), self.outputs, donate)

    def input_values(self):
        values = []
        for node in self.inputs:
            if node.op is ir.SCALAR:
                values.append(np.asarray(node.payload, to_numpy_dtype(node.dtype)))
            else:
                values.append(node.payload)
        return _colocate(values)

    def describe(self):
        """What a recompile log compares: input avals and the op sequence."""
        ins = [(tuple(n.shape), n.dtype, n.sharding) if n.op is ir.DATA else ("scalar", n.dtype)
               for n in self.inputs]
        ops = [str(n.op) for n in self.order if n.op is not ir.DATA and n.op is not ir.SCALAR]
        return ins, ops


# [Note: default placement on a sub-mesh]
# Unannotated data is replicated over every device. A graph that also reads data laid out on a mesh
# over fewer devices (e.g. FSDP on Mesh(range(4), (4,), ('fsdp',))) would mix device sets, which jit
# refuses ("incompatible devices"); such default-placed inputs are copied, replicated, onto the
# devices of the other inputs. Only when those all share one device set: a graph mixing two
# different sub-meshes is the user's error, and jit says so.
def _colocate(values):
    all_devices = len(runtime.devices())
    if all_devices == 1:
        return values
    placed, default = set(), []
    for i, v in enumerate(values):
        sharding = getattr(v, "sharding", None)
        if sharding is None:
            continue
        devices = sharding.device_set
        if len(devices) == all_devices:
            if sharding.is_fully_replicated:
                default.append(i)
        else:
            placed.add(frozenset(devices))
    if not default or len(placed) != 1:
        return values
    target = _replicated_on(next(iter(placed)))
    values = list(values)
    for i in default:
        v = values[i]
        if isinstance(v, jax.ShapeDtypeStruct):
            values[i] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target)
        else:
            values[i] = jax.device_put(v, target)
    return values


_REPLICATED_ON: dict = {}


def _replicated_on(devices: frozenset):
    sharding = _REPLICATED_ON.get(devices)
    if sharding is None:
        mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("xshard_sub",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        _REPLICATED_ON[devices] = sharding
    return sharding


class Program:
    """The payload-free description of a graph that the traced function interprets."""

    def __init__(self, graph: Graph):
        self.steps = []
        for node, kids in zip(graph.order, graph.children):
            if node.op is ir.DATA or (not kids and node.inputs):
                self.steps.append(("data", graph.inputs.index(node), tuple(node.shape)))
            elif node.op is ir.SCALAR:
                self.steps.append(("scalar", graph.inputs.index(node), None))
            elif node.op is ir.OUTPUT:
                self.steps.append(("output", kids[0], node.template))
            else:
                rule = RULES.get(node.op)
                if rule is None:
                    raise LoweringError(f"no lowering rule for {node.op}")
                self.steps.append(("op", kids, (node.op, rule, node.template, node.shape,
                                                node.dtype, node.outputs, node.sharding)))
        self.outputs = graph.outputs

    def __call__(self, *inputs):
        vals = []
        for kind, a, b in self.steps:
            if kind == "data":
                x = inputs[a]
                if x.shape != b:  # padded device data: the logical value is the leading block
                    x = x[tuple(slice(0, n) for n in b)]
                vals.append(x)
            elif kind == "scalar":
                vals.append(_lax_internal._convert_element_type(inputs[a], weak_type=True))
            elif kind == "output":
                vals.append(vals[a][b])
            else:
                vals.append(_apply(a, b, vals))
        return tuple(vals[o] for o in self.outputs)


def _apply(kids, spec, vals):
    op, rule, template, shape, dtype, outputs, sharding = spec
    args = [vals[k] for k in kids]
    targs, tkwargs = template
    call_args = _thaw(targs, args)
    call_kwargs = {k: _thaw(v, args) for k, v in tkwargs}
    try:
        out = rule(*call_args, **call_kwargs)
    except Exception as e:
        raise LoweringError(f"lowering {op} failed: {type(e).__name__}: {e}") from e
    if outputs is None:
        out = _conform(out, shape, dtype, op)
        if sharding is not None:
            out = jax.lax.with_sharding_constraint(out, sharding)
        return out
    return tuple(None if meta is None or o is None else _conform(o, meta[0], meta[1], op)
                 for o, meta in zip(out, outputs))


def _thaw(x, args):
    if type(x) is ir.Slot:
        return args[x.index]
    if type(x) is tuple:
        return tuple(_thaw(v, args) for v in x)
    return x


def _conform(x, shape, dtype, op):
    x = jax.numpy.asarray(x)
    want = to_numpy_dtype(dtype)
    if x.dtype != want:
        x = x.astype(want)
    if tuple(x.shape) != tuple(shape):
        if x.size == int(np.prod(shape)):
            x = x.reshape(shape)
        else:
            raise LoweringError(
                f"lowering of {op} produced shape {tuple(x.shape)}, PyTorch expects {tuple(shape)}")
    return x


# -- the executable cache ----------------------------------------------------------------------


class Executable:
    __slots__ = ("compiled", "describe", "lowered")

    def __init__(self, compiled, describe, lowered):
        self.compiled = compiled
        self.describe = describe
        self.lowered = lowered


_CACHE: dict = {}


def _lower(graph: Graph):
    program = Program(graph)
    jitted = jax.jit(program, donate_argnums=graph.donate)
    with warnings.catch_warnings():
        # Donation is offered for every buffer no live tensor holds; XLA reuses those it can.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return jitted.lower(*graph.input_values())


# Compiler options a graph needs because it contains some op: op -> function returning a dict of
# XLA debug options (e.g. barrier.py's, see [Note: barriers on the CPU backend]).
OP_COMPILER_OPTIONS: dict = {}


def compiler_options(graph: Graph) -> dict:
    """The XLA options for compiling ``graph``: the union of those its ops ask for."""
    options = {}
    for op in {node.op for node in graph.order} & OP_COMPILER_OPTIONS.keys():
        options.update(OP_COMPILER_OPTIONS[op]())
    return options


def compile_graph(graph: Graph, lowered=None):
    """Compiles ``graph`` (lowered already, or lowered here) with the options its ops need."""
    if lowered is None:
        lowered = _lower(graph)
    options = compiler_options(graph)
    if options:
        try:
            return lowered.compile(options)
        except jax.errors.JaxRuntimeError as e:
            if "option" not in str(e):
                raise
            # An XLA that does not know one of these options: compile as it would by default.
            warnings.warn(f"xshard: compiling without {sorted(options)}: {e}", stacklevel=2)
    return lowered.compile()


def executable(graph: Graph) -> Executable:
    key = (graph.key, tuple(n.sharding for n in graph.inputs if n.op is ir.DATA))
    exe = _CACHE.get(key)
    if exe is not None:
        metrics.METRICS.cache_hits += 1
        return exe
    _log_recompile(graph)
    start = time.perf_counter()
    lowered = _lower(graph)
    compiled = compile_graph(graph, lowered)
    metrics.METRICS.record_compile(time.perf_counter() - start)
    exe = Executable(compiled, graph.describe(), lowered)
    _CACHE[key] = exe
    return exe


def _log_recompile(graph: Graph):
    if not _CACHE or not log.isEnabledFor(logging.DEBUG):
        return
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
    log.debug("xshard recompiles a graph of %d ops; nearest cached graph differs in: %s",
              len(ops), "; ".join(reasons) or "static op arguments")


# -- shardings -----------------------------------------------------------------------------------
#
# A sharding reaches core as an opaque annotation object with ``jax_sharding`` (a jax Sharding over
# the *padded* shape) and ``padded_shape(shape)`` (each dimension rounded up to a multiple of its
# tile count). Inside a graph XLA handles dimensions that do not divide; at the boundary jax.Array
# refuses them, so annotated results leave a graph padded at the end of each dimension and enter the
# next one sliced back to their logical shape (see ``Program``).

CONSTRAIN = "xshard.sharding_constraint"
SHARD_OUTPUT = "xshard.shard_output"


def _constrain(x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding)


def _shard_output(x, padded_shape, sharding):
    pads = [(0, p - n, 0) for n, p in zip(x.shape, padded_shape)]
    if any(hi for _, hi, _ in pads):
        x = jax.lax.pad(x, jax.numpy.zeros((), x.dtype), pads)
    return jax.lax.with_sharding_constraint(x, sharding)


RULES[CONSTRAIN] = _constrain
RULES[SHARD_OUTPUT] = _shard_output


# [Note: per-device partial sums]
# GSPMD has no annotation for a value that each device holds a different addend of (an "unreduced"
# value): a logical value is always whole, so XLA reduces a contraction over a sharded dimension
# where it happens. ``PARTIAL_SUM`` spells such a value out: its input has one leading row per device
# (sharded on that dimension, so each device holds its own row) and its value is the sum of the
# rows. A sync keeps the rows as they are and the cell's value stays ``PARTIAL_SUM(data)``, which
# counts as computed (``settled``); the sum, and with it the collective, happens only in the graph
# that reads the value. FSDP's ``no_sync`` accumulates gradients this way (see xshard.core.partial).
PARTIAL_SUM = "xshard.partial_sum"


def _partial_sum(rows, sharding):
    return jax.numpy.sum(jax.lax.with_sharding_constraint(rows, sharding), axis=0)


RULES[PARTIAL_SUM] = _partial_sum


def partial_sum(rows: ir.Node, sharding) -> ir.Node:
    """The sum over the leading dimension of ``rows``, each row kept on its own device(s) under the
    jax ``sharding`` until a graph reads the sum."""
    return ir.Node(PARTIAL_SUM, (rows,), ((ir.Slot(0), sharding), ()), rows.shape[1:], rows.dtype)


def settled(value: ir.Node) -> bool:
    """Whether ``value`` needs no computation in a sync: device data, or a partial sum of it."""
    return value.is_data or (value.op == PARTIAL_SUM and value.inputs[0].is_data)


def _stored(value: ir.Node) -> ir.Node:
    """The node a sync computes and stores for a cell holding ``value``."""
    return value.inputs[0] if value.op == PARTIAL_SUM else value


def constrain(value: ir.Node, annotation) -> ir.Node:
    """``value`` with a sharding constraint: how XLA must lay it out at this point."""
    return constrain_jax(value, annotation.jax_sharding)


def constrain_jax(value: ir.Node, sharding) -> ir.Node:
    return ir.Node(CONSTRAIN, (value,), ((ir.Slot(0), sharding), ()), value.shape, value.dtype)


def _output(value: ir.Node, annotation) -> ir.Node:
    if annotation is None:
        return value
    padded = tuple(annotation.padded_shape(value.shape))
    return ir.Node(SHARD_OUTPUT, (value,), ((ir.Slot(0), padded, annotation.jax_sharding), ()),
                   padded, value.dtype)


# -- running ---------------------------------------------------------------------------------------


def _seq(cell):
    return cell.seq


class PendingStep:
    """What a sync would run now: the pending cells, their graph, and which output each gets."""

    __slots__ = ("cells", "owners", "graph")

    def __init__(self):
        live = list(LIVE_CELLS)
        self.cells = sorted((c for c in live if not settled(c.value)
                             and not c.value.manual and c.error is None), key=_seq)
        held = {id(_stored(c.value).payload) for c in live if settled(c.value)}
        # Values inside an open manual region stay pending and may read any input: donate nothing.
        open_region = any(c.value.manual for c in live)
        outputs, seen, self.owners = [], {}, []
        for c in self.cells:
            key = (id(c.value), c.sharding)
            if key not in seen:
                seen[key] = len(outputs)
                if c.value.op == PARTIAL_SUM:
                    outputs.append(constrain_jax(c.value.inputs[0], c.value.template[0][1]))
                else:
                    outputs.append(_output(c.value, c.sharding))
            self.owners.append(seen[key])
        self.graph = Graph(outputs,
                           donate_ok=lambda array: not open_region and id(array) not in held)


def pending_step() -> PendingStep:
    return PendingStep()


def sync(wait: bool = False) -> None:
    """Compiles (or reuses) and dispatches one graph computing every pending live tensor."""
    step = PendingStep()
    if not step.cells:
        if wait:
            wait_all()
        return
    graph = step.graph
    _check_runnable(graph)
    try:
        exe = executable(graph)
    except Exception as error:
        _quarantine(step.cells, error)
        raise
    start = time.perf_counter()
    results = exe.compiled(*graph.input_values())
    metrics.METRICS.record_execute(time.perf_counter() - start)
    for c, pos in zip(step.cells, step.owners):
        node = _stored(c.value)
        array = _placed(results[pos])
        data = ir.data_node(array, node.shape, node.dtype, array.sharding)
        c.write(partial_sum(data, c.value.template[0][1]) if node is not c.value else data)
    if wait:
        wait_all()


def _placed(array):
    """Unannotated data lives replicated over all devices (see default_sharding).

    A graph without device data among its inputs (``torch.ones(..., device=d)`` and the like) runs
    on one device; left there, its results would give the next step another input layout, and so
    another executable than the steady state's.
    """
    if isinstance(array.sharding, jax.sharding.SingleDeviceSharding) and runtime.device_count() > 1:
        return jax.device_put(array, default_sharding())
    return array


def _quarantine(cells, error) -> None:
    """After a graph failed to compile: marks the pending cells whose own graph fails (all of them
    when none fails alone), so later syncs run the rest. Reading a marked tensor raises again."""
    failed = False
    for c in cells:
        try:
            _lower(Graph([c.value]))
        except Exception as e:  # noqa: BLE001  (any lowering error marks the cell)
            c.error = e
            failed = True
    if not failed:
        for c in cells:
            c.error = error


def evaluate(nodes) -> list:
    """Computes ``nodes`` without binding the results to any tensor (no donation)."""
    graph = Graph(list(nodes))
    _check_runnable(graph)
    exe = executable(graph)
    start = time.perf_counter()
    out = exe.compiled(*graph.input_values())
    metrics.METRICS.record_execute(time.perf_counter() - start)
    return list(out)


def wait_all() -> None:
    """Blocks until every dispatched computation has finished."""
    for c in list(LIVE_CELLS):
        if settled(c.value):
            _stored(c.value).payload.block_until_ready()


def clear_cache() -> None:
    _CACHE.clear()
