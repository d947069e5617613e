"""The lazy IR: one immutable node type, and every op a node can hold.

A ``Node`` is one value of a lazy graph. Its ``op`` says how the value is computed, from ``inputs``
(other nodes) and a static ``template``: the call's ``(args, kwargs)`` with each tensor or dynamic
scalar replaced by a ``Slot`` into ``inputs``. ``shape``/``dtype`` describe the value; a node with
several results has ``outputs``, one ``(shape, dtype)`` per result, instead, and ``OUTPUT`` nodes pick
them. ``manual`` marks values inside a manual-sharding region (per-device shards, see xshard.spmd).

The ops, all of them (each computed op has exactly one lowering rule, in xshard.core.lowering):

=========================  =========================================================================
op                         meaning
=========================  =========================================================================
``DATA``                   device data: ``payload`` is a ``jax.Array`` (maybe in flight), or under
                           ``compile_only()`` a ``jax.ShapeDtypeStruct``; ``sharding`` its layout
                           (a ``PackedData`` node cuts its array out of a larger one when read)
``SCALAR``                 a scalar that enters the graph as an input, so a value that changes every
                           step (a learning rate, an RNG counter) does not change the program;
                           ``payload`` is the Python value; weak (a Python number: promotes like one)
                           or strong (a 0-dim CPU tensor of ``dtype``), see ``scalar_node``
``OUTPUT``                 result ``template`` (an int) of the multi-output node ``inputs[0]``
an aten ``OpOverload``     the aten op, from inputs and static arguments
=========================  =========================================================================

xshard's own ops (strings, ``"xshard.*"``):

=========================  =========================================================================
``RNG_KEY``                threefry key data for one random op: the stream's seed and counter (two
                           scalars) folded into a key (see xshard.core.rng)
``WEAK``                   the input (0-dim, of a Python number's dtype: bool, int64, float64 or
                           complex128), weakly typed: a Python number computed in the graph (a
                           compiled step's number argument, see ``weak``)
``CONSTRAIN``              the input, laid out as the jax sharding in the template says at this point
``SHARD_OUTPUT``           the input padded to the template's shape, laid out as its sharding: how
                           an annotated result leaves a graph (jax.Array refuses uneven shardings)
``PARTIAL_SUM``            the sum over the leading dimension of its input, one row per device: a
                           value kept unreduced until a graph reads it (FSDP's ``no_sync``)
``SCATTERED_SUM``          the same sum, its result split over those devices along its first
                           dimension (a reduce-scatter): FSDP's gradients of a unit, reduced at once
``PER_DEVICE``             an op run per block of the batch under ``vmap``, giving one row per device
                           (how ``no_sync`` gradients become partial sums; see xshard.fsdp.partial)
``FIRST_ROW``              the input in row 0 of ``n`` rows, zeros elsewhere
``BARRIER``                its inputs behind an optimisation barrier, in program order
``CSE_BARRIER``            the same, asking only that XLA not merge computation across it
``MANUAL_ENTER``           the local shard of its input: opens a manual-sharding region
``MANUAL_REGION``          a closed region: its subgraph run per device by ``jax.shard_map``
``ALL_REDUCE`` ...         the collectives inside a region: ``ALL_REDUCE``, ``ALL_GATHER``,
                           ``REDUCE_SCATTER``, ``ALL_TO_ALL``, ``PPERMUTE`` over named mesh axes
=========================  =========================================================================

[Note: exact keys]
Two graphs may share an executable only if they are the same program. A node's ``key`` is a small
integer naming its op, static arguments, shape and dtype (its inputs are positions in the graph, see
xshard.core.graph), interned from a type-tagged form of those: ``hash()`` alone cannot serve (in
CPython ``hash(-1) == hash(-2)``), nor can plain equality (``1 == 1.0 == True``, ``-0.0 == 0.0``,
``nan != nan``). So every static scalar is compared with its type, floats by their exact bits
(``float.hex``), lists apart from tuples; other static values (dtypes, strings, slots, shardings)
compare by their own ``==`` together with their type. Data contributes shape, dtype and sharding;
a scalar input its type, dtype and weakness. The recorder interns a node's key together with its
meta-kernel result (one lookup per op, see xshard.core.record); other nodes compute it here.
"""

from __future__ import annotations

import torch

DATA = "xshard.data"
SCALAR = "xshard.scalar"
OUTPUT = "xshard.output"

RNG_KEY = "xshard.rng_key"
CONSTRAIN = "xshard.sharding_constraint"
WEAK = "xshard.weak"
SHARD_OUTPUT = "xshard.shard_output"
PARTIAL_SUM = "xshard.partial_sum"
SCATTERED_SUM = "xshard.scattered_sum"
PER_DEVICE = "xshard.per_device"
FIRST_ROW = "xshard.first_row"
BARRIER = "xshard.optimization_barrier"
CSE_BARRIER = "xshard.cse_barrier"
MANUAL_ENTER = "xshard.manual_enter"
MANUAL_REGION = "xshard.manual_region"
ALL_REDUCE = "xshard.all_reduce"
ALL_GATHER = "xshard.all_gather"
REDUCE_SCATTER = "xshard.reduce_scatter"
ALL_TO_ALL = "xshard.all_to_all"
PPERMUTE = "xshard.ppermute"

# Ops the graph interpreter handles itself (no lowering rule).
STRUCTURAL = (DATA, SCALAR, OUTPUT)
# xshard's computed ops; each has a rule in xshard.core.lowering.xshard_ops.
XSHARD_OPS = (RNG_KEY, WEAK, CONSTRAIN, SHARD_OUTPUT, PARTIAL_SUM, SCATTERED_SUM, PER_DEVICE,
              FIRST_ROW, BARRIER, CSE_BARRIER, MANUAL_ENTER, MANUAL_REGION, ALL_REDUCE,
              ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, PPERMUTE)
BARRIERS = (BARRIER, CSE_BARRIER)


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


_SLOTS = [Slot(i) for i in range(64)]


def slot(index: int) -> Slot:
    """The (shared, immutable) ``Slot`` for input ``index``."""
    return _SLOTS[index] if index < 64 else Slot(index)


class Node:
    __slots__ = ("op", "inputs", "template", "shape", "dtype", "outputs", "payload", "sharding",
                 "key", "manual", "holders", "placed")

    def __init__(self, op, inputs=(), template=None, shape=None, dtype=None, outputs=None,
                 payload=None, sharding=None, key=None):
        self.op = op
        self.inputs = inputs
        self.template = template
        self.shape = shape
        self.dtype = dtype
        self.outputs = outputs
        self.payload = payload
        self.sharding = sharding  # DATA only: the jax sharding of the payload
        if key is None:
            key = intern_key(_local(op, template, shape, dtype, outputs, payload, sharding))
        self.key = key
        # A value inside a manual-sharding region can leave it only through MANUAL_REGION.
        if op is MANUAL_ENTER:
            self.manual = True
        elif op is MANUAL_REGION:
            self.manual = False
        else:
            manual = False
            for i in inputs:
                if i.manual:
                    manual = True
                    break
            self.manual = manual

    @property
    def is_data(self) -> bool:
        return self.op is DATA

    def __repr__(self):
        if self.op is DATA:
            return f"Data({list(self.shape)}, {self.dtype})"
        if self.op is SCALAR:
            return f"Scalar({self.payload!r})"
        return f"Node({self.op}, {len(self.inputs)} inputs)"


def _local(op, template, shape, dtype, outputs, payload, sharding):
    if op is DATA:
        return (DATA, shape, dtype, sharding)
    if op is SCALAR:
        return (SCALAR, type(payload), dtype, template)
    return (op_code(op), exact(template), shape, dtype, exact(outputs))


# [Note: exact keys] interned: type-tagged static part -> small int.
_KEYS: dict = {}


def intern_key(local) -> int:
    """The small integer naming ``local``, a key already in exact form (see ``exact``)."""
    key = _KEYS.get(local)
    if key is None:
        key = _KEYS[local] = len(_KEYS)
    return key


def exact(x):
    """``x`` in a form whose ``==`` holds only between values of the same type and bits."""
    t = type(x)
    if t is Slot or x is None or t is str:
        return x
    if t is tuple:
        return tuple([exact(v) for v in x])
    if t is float:
        return (float, x.hex())
    if t is list:
        return (list, tuple([exact(v) for v in x]))
    if isinstance(x, float):  # numpy floats
        return (t, float(x).hex())
    if isinstance(x, complex):
        return (t, x.real.hex(), x.imag.hex())
    return (t, x)


# Aten overloads as small integers, keyed by identity: an OpOverload's own __hash__ is a Python
# method, too slow to run several times per recorded op.
_OP_CODES: dict = {}
_OPS_BY_CODE: list = []


def op_code(op):
    """A small integer naming aten overload ``op`` (xshard's string ops name themselves)."""
    if type(op) is str:
        return op
    code = _OP_CODES.get(id(op))
    if code is None:
        code = _OP_CODES[id(op)] = len(_OPS_BY_CODE)
        _OPS_BY_CODE.append(op)  # held: its id stays its own
    return code


def data_node(array, shape, dtype, sharding=None) -> Node:
    """A node holding device data; ``shape`` is the logical (unpadded) shape."""
    if sharding is not None:
        sharding = _representative(sharding, len(shape))
    node = Node(DATA, shape=tuple(shape), dtype=dtype, payload=array, sharding=sharding)
    node.holders = 0  # cells holding this data (see [Note: pending cells and held data])
    node.placed = None  # its layout on a graph's devices (see xshard.core.placement)
    return node


_PAYLOAD = Node.payload  # the slot itself (PackedData's payload is a property over it)


def data_node_maker(shape, dtype, sharding, cls=None):
    """``array -> data_node(array, shape, dtype, sharding)`` for arrays of one shape, dtype and
    sharding, with the node's key computed once (a compiled step stores the same outputs on every
    call; see xshard.step); nodes of class ``cls`` (default ``Node``)."""
    proto = data_node(None, shape, dtype, sharding)
    shape, sharding, key = proto.shape, proto.sharding, proto.key
    new, cls, set_payload = object.__new__, cls or Node, _PAYLOAD.__set__

    def make(array) -> Node:
        node = new(cls)
        node.op, node.inputs, node.template, node.shape, node.dtype = DATA, (), None, shape, dtype
        node.outputs, node.sharding, node.key = None, sharding, key
        set_payload(node, array)
        node.manual, node.holders, node.placed = False, 0, None
        return node

    return make


class PackedData(Node):
    """A DATA node whose array is one member of a packed array (``pack``, member ``member``; see
    [Note: packed state] in xshard/step/packing.py): ``payload`` cuts the pack's members out the
    first time it is read."""

    __slots__ = ("pack", "member", "__weakref__")

    @property
    def payload(self):
        array = _PAYLOAD.__get__(self)
        if array is None:
            array = self.pack.member(self.member)
            _PAYLOAD.__set__(self, array)
        return array

    @payload.setter
    def payload(self, array):
        _PAYLOAD.__set__(self, array)

    def move_to(self, pack) -> None:
        """Makes this node member ``member`` of ``pack``, a pack of the same layout, instead of
        its pack (whole: never cut out). Only for a node nothing but its storage holds: a
        compiled step writing the next value of its state (see [Note: packed state])."""
        self.pack, self.placed = pack, None

    def arrays(self) -> tuple:
        """The array this node keeps alive: the packed one, or its own once cut out."""
        own = _PAYLOAD.__get__(self)
        return (self.pack.array,) if own is None else (own,)


def packed_data_maker(shape, dtype, sharding):
    """``(pack, member) -> PackedData``, as ``data_node_maker`` makes data nodes."""
    make_data = data_node_maker(shape, dtype, sharding, PackedData)

    def make(pack, member) -> PackedData:
        node = make_data(None)
        node.pack, node.member = pack, member
        return node

    return make


def arrays_of(node: Node) -> tuple:
    """The device arrays data node ``node`` keeps alive."""
    if type(node) is PackedData:
        return node.arrays()
    return (node.payload,)


# Equivalent jax shardings (a NamedSharding and the GSPMDSharding XLA hands back for the same
# layout) compare unequal; a data node keeps one representative per layout so that the graph key,
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


_WEAK_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64,
                complex: torch.complex128}


def scalar_node(value, dtype=None) -> Node:
    """A scalar graph input. Without ``dtype``: a Python number, weakly typed (it promotes like a
    Python scalar). With ``dtype``: the value of a 0-dim CPU tensor, strongly typed."""
    if dtype is None:
        return Node(SCALAR, payload=value, shape=(), dtype=_WEAK_DTYPES[type(value)],
                    template="weak")
    return Node(SCALAR, payload=value, shape=(), dtype=dtype, template="strong")


# A Python number's type -> the dtype its value has in a graph, and back.
NUMBER_TYPES = {dtype: kind for kind, dtype in _WEAK_DTYPES.items()}


def weak(value: Node) -> Node:
    """``value``, a 0-dim node of a Python number's dtype, standing for a Python number: an op
    promotes it as ATen promotes a number (``bf16_0d * s`` stays bfloat16; ``f32_tensor * s``
    computes with ``s`` rounded to float32 once), and an op of such numbers alone computes as
    Python does (in float64 or int64), giving another. See [Note: numbers in a graph] in
    xshard.core.record."""
    return Node(WEAK, (value,), ((slot(0),), ()), (), value.dtype)


def output_node(multi: Node, index: int) -> Node:
    shape, dtype = multi.outputs[index]
    key = _OUTPUT_KEYS.get((multi.key, index))
    if key is None:  # a multi-output node's key determines its outputs' shapes and dtypes
        key = _OUTPUT_KEYS[(multi.key, index)] = intern_key((OUTPUT, index, shape, dtype))
    return Node(OUTPUT, (multi,), index, shape, dtype, key=key)


_OUTPUT_KEYS: dict = {}


def constrain(value: Node, jax_sharding) -> Node:
    """``value`` laid out as ``jax_sharding`` says at this point of the graph."""
    return Node(CONSTRAIN, (value,), ((slot(0), jax_sharding), ()), value.shape, value.dtype)


def shard_output(value: Node, padded_shape: tuple, jax_sharding) -> Node:
    """``value`` padded to ``padded_shape`` and laid out as ``jax_sharding``: how an annotated
    result leaves a graph."""
    return Node(SHARD_OUTPUT, (value,), ((slot(0), padded_shape, jax_sharding), ()),
                padded_shape, value.dtype)


def partial_sum(rows: Node, jax_sharding) -> Node:
    """The sum over the leading dimension of ``rows``, each row kept on its own device(s) under
    ``jax_sharding`` until a graph reads the sum."""
    return Node(PARTIAL_SUM, (rows,), ((slot(0), jax_sharding), ()), rows.shape[1:], rows.dtype)


def scattered_sum(rows: Node, jax_sharding) -> Node:
    """The sum over the leading dimension of ``rows`` (``n`` rows laid out by the ``NamedSharding``
    ``jax_sharding``, the first dimension split over some mesh axes), computed as a reduce-scatter:
    the result's first dimension (``n`` long too) is split over the same axes."""
    if rows.shape[1] != rows.shape[0]:
        raise ValueError(f"scattered_sum needs as many blocks as rows, got shape {rows.shape}")
    return Node(SCATTERED_SUM, (rows,), ((slot(0), jax_sharding), ()), rows.shape[1:],
                rows.dtype)
