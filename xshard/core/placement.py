"""Placement: which devices, in which order, a graph and its data run on.

[Note: one device assignment per graph]
A jitted computation runs on one ordered list of devices, its device assignment; each input and
each sharding inside it must use that list, or jit refuses ("Received incompatible devices for
jitted computation"). xshard data may live on different lists: unannotated data is replicated over
every device in id order (``default_sharding``), while a mesh may list its devices in any order
(``Mesh(np.arange(8)[::-1], ...)``) or cover a subset of them (FSDP on
``Mesh([0, 1, 2, 3], ...)``). So each graph gets a placement plan (``plan``), made once per
executable (the plan is a function of the inputs' and the graph's shardings, which the graph key
holds, so one key always means one plan):

1. its target assignment is the one of the shardings inside it (sharding constraints, annotated
   outputs, partial sums, manual regions); these must agree, or the graph is refused with an error
   naming them. Failing those, the target is the assignment of the first input not laid out the
   default way (sharded inputs first); failing that, nothing moves;
2. each input on another assignment is brought onto the target: data replicated on every target
   device is re-viewed in the target's order without a copy; other replicated data is copied,
   replicated, onto the target's devices (``arrays.replicated_on``: from the local replica, never
   a cross-host transfer); sharded data is moved (``arrays.moved``) to the same partition spec over
   a mesh of the target's devices of the same shape, or replicated over the target when the two
   meshes differ in size. When the target is a mesh, every replicated input is re-viewed onto it
   even when the devices agree: jax reads the layouts XLA chose for the results against the mesh
   of an input (not always the first: a replicated mask on the default 1-D mesh, second, made
   ``where(mask, 3., x).sum(0)`` fail), and a 1-D mesh cannot express a 2-D tiling
   (IndivisibleError).

What an input becomes is kept with its data node (``Node.placed``), so a step that reads the same
data again (unannotated data read by every step of FSDP on a sub-mesh) does not copy it again.

Results that come back replicated over every device in another order, or on one device of several,
are laid out the default way (``canonical``; a re-view without a copy for the first), so the next
step sees the steady state's input layouts and reuses its executable. ``relayout`` moves one
tensor's data onto a sharding over any devices (what ``mark_sharding`` and ``clear_sharding`` do
to device data).
"""

from __future__ import annotations

import functools

import numpy as np

from xshard.core import arrays, ir, runtime
from xshard.core.padding import crop_array, pad_array

jax = runtime.jax_module()


class PlacementError(ValueError):
    """A graph lays values out over meshes with different device lists."""


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


_ASSIGNMENTS: dict = {}


def assignment(sharding) -> tuple:
    """The devices of ``sharding`` in its order (its device assignment)."""
    devices = _ASSIGNMENTS.get(sharding)
    if devices is None:
        devices = _ASSIGNMENTS[sharding] = tuple(sharding._device_assignment)
    return devices


@functools.lru_cache(maxsize=None)
def replicated_on(devices: tuple):
    """A replicated sharding over ``devices``, in that order (one object per device list)."""
    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("xshard_replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


# -- a graph's plan --------------------------------------------------------------------------------

# Ops whose static arguments hold a jax sharding or mesh: the graph's device assignment follows
# them.
PLACING_OPS = frozenset({ir.CONSTRAIN, ir.SHARD_OUTPUT, ir.PARTIAL_SUM, ir.SCATTERED_SUM,
                         ir.MANUAL_REGION})


def _place(obj):
    """Where a jax ``Sharding`` or ``Mesh`` in a node's static arguments puts values: a jax Mesh
    (NamedSharding, Mesh), a tuple of devices (other shardings), or None (not a placement)."""
    if isinstance(obj, jax.sharding.NamedSharding):
        return obj.mesh
    if isinstance(obj, jax.sharding.Mesh):
        return obj
    if isinstance(obj, jax.sharding.Sharding):
        return assignment(obj)
    return None


def _devices(place) -> tuple:
    return tuple(place.devices.flat) if isinstance(place, jax.sharding.Mesh) else place


def placements_of(template) -> list:
    """Where the shardings and meshes in a node's ``template`` put values (see ``_place``)."""
    out = []
    stack = [template]
    while stack:
        obj = stack.pop()
        if type(obj) in (tuple, list):
            stack.extend(reversed(obj))
            continue
        place = _place(obj)
        if place is not None:
            out.append(place)
    return out


def _inside(graph) -> list:
    out = []
    for node in graph.order:
        op = node.op
        if type(op) is str and op in PLACING_OPS:
            out.extend(placements_of(node.template))
    return out


def _target(shardings, inside):
    """Where a graph whose data inputs are laid out by ``shardings``, with the placements
    ``inside`` it, runs (a jax Mesh or a tuple of devices), or None where its inputs need not
    move; see [Note: one device assignment per graph]."""
    if inside:
        by_devices = {}
        for place in inside:
            by_devices.setdefault(_devices(place), place)
        if len(by_devices) > 1:
            raise PlacementError(
                "one sync computes one XLA program, and this one lays values out over meshes "
                "with different device lists: "
                + "; ".join(f"devices {[runtime.position(d) for d in a]}" for a in by_devices)
                + ". A program runs on one ordered list of devices: annotate these tensors over "
                "one mesh, or compute them in separate steps (xshard.sync() after the first).")
        return inside[0]
    default = assignment(default_sharding())
    default_mesh = getattr(default_sharding(), "mesh", None)
    replicated = None
    for sharding in shardings:
        devices = assignment(sharding)
        on_mesh = isinstance(sharding, jax.sharding.NamedSharding)
        place = sharding.mesh if on_mesh else devices
        if not sharding.is_fully_replicated:
            # Sharded over a mesh of the default devices (a 2x4 mesh of devices 0..7): the
            # replicated inputs go onto it too (see plan), for jax to read the results' layouts.
            if devices != default or (on_mesh and sharding.mesh != default_mesh):
                return place
            continue
        if devices != default:
            replicated = replicated or place
    return replicated


def replicated_sharding(graph):
    """A replicated sharding over the devices ``graph`` runs on, when it lays values out over
    several (None when nothing in it is sharded: it is replicated on the default devices)."""
    if runtime.device_count() == 1:
        return None
    target = _target([n.sharding for n in graph.inputs if n.op is ir.DATA
                      and n.sharding is not None], _inside(graph))
    if target is None:
        return None
    if isinstance(target, jax.sharding.Mesh):
        return jax.sharding.NamedSharding(target, jax.sharding.PartitionSpec())
    return replicated_on(_devices(target))


def plan(graph) -> tuple:
    """How ``graph``'s inputs are laid out before it runs: ``(input position, sharding)`` for each
    data input to move (see [Note: one device assignment per graph]); raises ``PlacementError``
    for a graph over meshes with different device lists."""
    if runtime.device_count() == 1:
        return ()
    data = [(i, n.sharding) for i, n in enumerate(graph.inputs)
            if n.op is ir.DATA and n.sharding is not None]
    target = _target([s for _, s in data], _inside(graph))
    if target is None:
        return ()
    devices = _devices(target)
    on_mesh = isinstance(target, jax.sharding.Mesh)
    replicated = jax.sharding.NamedSharding(target, jax.sharding.PartitionSpec()) if on_mesh \
        else replicated_on(devices)
    moves = []
    for i, sharding in data:
        if sharding.is_fully_replicated:
            # On a mesh every replicated input is re-viewed onto it: jax reads the results'
            # layouts against the mesh of an input, and a 1-D mesh cannot express a 2-D tiling.
            if sharding == replicated or (assignment(sharding) == devices and not on_mesh):
                continue
            moves.append((i, replicated))
        elif assignment(sharding) != devices:
            moves.append((i, _same_spec_on(sharding, devices)))
    return tuple(moves)


@functools.lru_cache(maxsize=256)
def _same_spec_on(sharding, target: tuple):
    """``sharding``'s partition spec over a mesh of the same shape made of ``target``'s devices
    (replicated over ``target`` when there is no such mesh)."""
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size == len(target):
        devices = np.array(target, dtype=object).reshape(sharding.mesh.devices.shape)
        mesh = jax.sharding.Mesh(devices, sharding.mesh.axis_names)
        return jax.sharding.NamedSharding(mesh, sharding.spec)
    return replicated_on(target)


def colocate(inputs, values: list, moves) -> list:
    """``values`` (the arrays of data nodes ``inputs``, or ``jax.ShapeDtypeStruct``s under
    compile-only) with the ``moves`` of the graph's plan applied; each input's new layout is kept
    with its data node, so the next step reading it reuses it."""
    for i, new in moves:
        value = values[i]
        if isinstance(value, jax.ShapeDtypeStruct):
            values[i] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=new)
        else:
            values[i] = placed(inputs[i], value, new)
    return values


def placed(node, value, new):
    """Data node ``node``'s array ``value`` laid out by ``new``, kept with the node (made once
    per node and layout)."""
    kept = node.placed
    if kept is not None and kept[0] is new:
        return kept[1]
    if value.sharding == new:  # already there (a compiled step's own result, read back)
        return value
    array = onto(value, new)
    node.placed = (new, array)
    return array


def onto(array, new):
    """``array`` laid out by the sharding ``new``: re-viewed without a copy when both are
    replicated and ``array`` is on every device of ``new``; copied from the local replica when
    both are replicated; else moved."""
    sharding = array.sharding
    if sharding.is_fully_replicated and new.is_fully_replicated:
        if new.device_set <= sharding.device_set:
            return _reviewed(array, new)
        return arrays.replicated_on(array, new)
    return arrays.moved(array, new)


def _reviewed(array, sharding):
    """Replicated ``array`` as an array of ``sharding`` (replicated too) over the same per-device
    buffers: no copy."""
    by_device = {shard.device: shard.data for shard in array.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        array.shape, sharding, [by_device[d] for d in sharding._addressable_device_assignment])


# -- results ---------------------------------------------------------------------------------------

_CANONICAL: dict = {}


def canonical(array):
    """A graph result as unannotated data is kept: replicated over every device in the default
    order (no copy) when it is replicated over every device in another order, or on one device
    while there are several; otherwise as it is.

    A graph without device data among its inputs (``torch.ones(..., device=d)`` and the like) runs
    on one device, and one over a mesh listing the devices in another order returns replicated
    results in that order; left so, its results would give the next step another input layout,
    and so another executable than the steady state's.
    """
    sharding = array.sharding
    entry = _CANONICAL.get(id(sharding))
    if entry is None or entry[0] is not sharding:  # decided once per sharding object
        entry = _CANONICAL[id(sharding)] = (sharding, _canonical_kind(sharding))
    kind = entry[1]
    if kind is None:
        return array
    if kind == "single":
        return arrays.replicated_from_local(array, default_sharding())
    return _reviewed(array, default_sharding())


def _canonical_kind(sharding):
    if runtime.device_count() == 1:
        return None
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return "single"
    if sharding.is_fully_replicated and len(sharding.device_set) == runtime.device_count() and \
            assignment(sharding) != assignment(default_sharding()):
        return "reorder"
    return None


# -- moving one tensor's data ------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _relayout_fn(logical_shape, padded_shape, out_sharding):
    """jit: the leading ``logical_shape`` block of its input, padded with zeros at the end of each
    dim to ``padded_shape``, laid out by ``out_sharding`` (None: where XLA likes)."""

    def relayout(x):
        return pad_array(crop_array(x, logical_shape), padded_shape)

    return jax.jit(relayout, out_shardings=out_sharding)


def relayout(node: ir.Node, sharding, padded_shape=None) -> ir.Node:
    """Device data ``node`` laid out by the jax ``sharding`` (over any devices, in any order),
    padded at the end of each dim to ``padded_shape`` (default: its logical shape); ``node``
    itself when it is laid out so already."""
    logical = tuple(node.shape)
    padded = tuple(padded_shape) if padded_shape is not None else logical
    array = node.payload
    if tuple(array.shape) == padded and array.sharding.is_equivalent_to(sharding, len(padded)):
        return node  # laid out so already
    if isinstance(array, jax.ShapeDtypeStruct):  # compile-only data: no values to move
        aval = jax.ShapeDtypeStruct(padded, array.dtype, sharding=sharding)
        return ir.data_node(aval, logical, node.dtype, sharding)
    if assignment(array.sharding) == assignment(sharding):
        array = _relayout_fn(logical, padded, sharding)(array)
    else:  # jit runs on one device assignment: crop/pad where the data is, then move it
        if tuple(array.shape) != padded:
            array = _relayout_fn(logical, padded, None)(array)
        array = onto(array, sharding)
    return ir.data_node(array, logical, node.dtype, array.sharding)
