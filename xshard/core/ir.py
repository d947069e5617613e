"""The lazy IR: one immutable node type.

A ``Node`` is one value of a lazy graph. Its ``op`` says how it is computed:

- ``DATA``: device data. ``payload`` is a ``jax.Array`` (already computed, possibly still in flight).
- ``SCALAR``: a Python scalar that enters the graph as an input, so a learning rate or loss scale that
  changes every step does not change the program. ``payload`` is the Python value.
- ``OUTPUT``: output ``template`` (an int) of the multi-output node ``inputs[0]``.
- anything else: an aten ``OpOverload`` or an xshard op name (``"xshard.*"``), computed by its lowering
  rule from ``inputs`` and the static arguments in ``template`` (the call's args and kwargs with each
  tensor or dynamic scalar replaced by a ``Slot`` into ``inputs``).

``manual`` marks values inside a manual-sharding region (per-device shards, see xshard.spmd).

``shape``/``dtype`` describe the value (for a multi-output node, ``outputs`` lists one ``(shape, dtype)``
per output instead). ``key`` is the node's own part of a graph's cache key (see [Note: exact keys]),
computed once, at construction.

[Note: exact keys]
Two graphs may share an executable only if they are the same program. A node's ``key`` is a small
integer naming its op, static arguments, shape and dtype (its inputs are positions in the graph, see
xshard.core.graph), interned from a type-tagged form of those: ``hash()`` alone cannot serve (in
CPython ``hash(-1) == hash(-2)``), nor can plain equality (``1 == 1.0 == True``, ``-0.0 == 0.0``,
``nan != nan``). So every static scalar is compared with its type, floats by their exact bits
(``float.hex``), lists apart from tuples; other static values (dtypes, strings, slots, shardings)
compare by their own ``==`` together with their type. Data contributes shape, dtype and sharding;
a Python scalar input its type.
"""

from __future__ import annotations

import torch

DATA = "xshard.data"
MANUAL_ENTRY: set = set()  # ops that start a manual region (see xshard.spmd.manual)
MANUAL_EXIT: set = set()  # ops that close one
SCALAR = "xshard.scalar"
OUTPUT = "xshard.output"


class Slot:
    """Placeholder for the ``index``-th input of a node inside its static ``template``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __eq__(self, other):
        return type(other) is Slot and other.index == self.index

    def __hash__(self):
        return hash(("slot", self.index))

    def __repr__(self):
        return f"%{self.index}"


class Node:
    __slots__ = ("op", "inputs", "template", "shape", "dtype", "outputs", "payload", "sharding",
                 "key", "manual")

    def __init__(self, op, inputs=(), template=None, shape=None, dtype=None, outputs=None,
                 payload=None, sharding=None):
        self.op = op
        self.inputs = inputs
        self.template = template
        self.shape = shape
        self.dtype = dtype
        self.outputs = outputs
        self.payload = payload
        # DATA: the jax sharding of the payload. Others: a sharding constraint to apply to the value,
        # an opaque object with a ``jax_sharding`` attribute and a ``key`` (see spmd).
        self.sharding = sharding
        if op is DATA:
            local = (DATA, shape, dtype, sharding)
        elif op is SCALAR:
            local = (SCALAR, type(payload))
        else:
            local = (op, exact(template), shape, dtype, exact(outputs))
        key = _KEYS.get(local)
        if key is None:
            key = _KEYS[local] = len(_KEYS)
        self.key = key
        # Inside a manual-sharding region (per-device values): such a value can only leave the
        # region through its closing op, never become a graph output on its own.
        self.manual = op in MANUAL_ENTRY or (op not in MANUAL_EXIT and any(
            i.manual for i in inputs))

    @property
    def is_data(self) -> bool:
        return self.op is DATA

    def __repr__(self):
        if self.op is DATA:
            return f"Data({list(self.shape)}, {self.dtype})"
        if self.op is SCALAR:
            return f"Scalar({self.payload!r})"
        return f"Node({self.op}, {len(self.inputs)} inputs)"


# Interned node keys: type-tagged static part -> small int (see [Note: exact keys]).
_KEYS: dict = {}


def exact(x):
    """``x`` in a form whose ``==`` holds only between values of the same type and bits."""
    t = type(x)
    if t is tuple:
        return tuple([exact(v) for v in x])
    if t is Slot or x is None or t is str:
        return x
    if t is float:
        return (float, x.hex())
    if t is list:
        return (list, tuple([exact(v) for v in x]))
    if isinstance(x, float):  # numpy floats
        return (t, float(x).hex())
    if isinstance(x, complex):
        return (t, x.real.hex(), x.imag.hex())
    return (t, x)


def data_node(array, shape, dtype, sharding=None) -> Node:
    """A node holding device data; ``shape`` is the logical (unpadded) shape."""
    if sharding is not None:
        sharding = _representative(sharding, len(shape))
    return Node(DATA, shape=tuple(shape), dtype=dtype, payload=array, sharding=sharding)


# Equivalent jax shardings (a NamedSharding and the GSPMDSharding XLA hands back for the same
# layout) hash differently; a data node keeps one representative per layout so that the graph key,
# and with it the executable cache, does not change between steps that lay data out the same way.
_REPRESENTATIVES: dict = {}
_BY_LAYOUT: dict = {}


def _representative(sharding, ndim: int):
    key = (sharding, ndim)
    rep = _REPRESENTATIVES.get(key)
    if rep is None:
        try:
            layout = (str(sharding._to_xla_hlo_sharding(ndim)),
                      tuple(d.id for d in sharding._device_assignment), sharding.memory_kind)
        except Exception:  # a sharding kind without an HLO form: keep it as it is
            layout = key
        rep = _REPRESENTATIVES[key] = _BY_LAYOUT.setdefault(layout, sharding)
    return rep


def scalar_node(value) -> Node:
    return Node(SCALAR, payload=value, shape=(), dtype=_SCALAR_DTYPES[type(value)])


def output_node(multi: Node, index: int) -> Node:
    shape, dtype = multi.outputs[index]
    return Node(OUTPUT, (multi,), index, shape, dtype)


_SCALAR_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64,
                  complex: torch.complex128}
