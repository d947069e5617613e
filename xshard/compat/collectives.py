"""Collectives between ``xmp.spawn`` replicas: device values through JAX, host objects through gloo.

Each replica is its own xshard world (see ``xshard.compat._world``), but JAX still knows every
process's devices (``jax.distributed``). A collective over device values is one jitted
``shard_map`` over a mesh with one device per process (``replicas``): each process wraps its local
values as its block of a global array, the program runs ``psum`` / ``pmax`` / ``pmin`` (or an
``all_gather`` and a local reduction for products and bitwise and/or) on every process at once, and
each process takes the replicated result from its own device. On CPU JAX runs the collective over
gloo, on GPU over NCCL; values never leave the devices.

[Note: one collective for many tensors]
``xm.optimizer_step`` reduces every gradient in one program and one variadic ``psum``. Each
operand of a cross-process all-reduce costs about a millisecond of latency on CPU (gloo), so tensors
under ``BUCKET_ELEMENTS`` are concatenated per dtype into one operand (as torch_xla's gradient
buckets) and split back; larger ones travel as operands of their own, because XLA:CPU copies a
reshaped matrix into a concatenation slowly (18 ms for a 1024 x 1024 float32 one beside a vector,
against 0.5 ms when both are vectors, jitted on one CPU device). A BatchNorm CNN's 12
gradients: one operand; a 4 x (1024 x 1024) MLP: 4 weights and one bucket of biases.
Programs are cached by (op, scale, each tensor's shape and dtype), compared exactly.

Before each collective the processes check, through the coordinator, that they are all about to
run the same one (``xshard.core.divergence.before_collective``): a replica that skips it, calls it
with other shapes, or has failed gives a clear error instead of a hang (``XSHARD_CHECK=off`` skips
this; about 1 ms on loopback).

Host objects (``xm.rendezvous`` payloads, ``xm.mesh_reduce`` data) go through the gloo
``torch.distributed`` group ``xshard.initialize()`` created.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from xshard.core import api, capture, divergence, runtime

jax = runtime.jax_module()
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

AXIS = "replicas"

# Reduce types with a collective of their own (inside shard_map, over a value or a tuple of them)...
_PRIMITIVES = {
    "sum": lambda x: jax.lax.psum(x, AXIS),
    "max": lambda x: jax.lax.pmax(x, AXIS),
    "min": lambda x: jax.lax.pmin(x, AXIS),
}
# ...and those computed from an all-gather (replicas on axis 0), reduced locally.
_GATHERED = {
    "mul": lambda g: jnp.prod(g, axis=0, dtype=g.dtype),
    "and": lambda g: jnp.bitwise_and.reduce(g, axis=0) if g.dtype != jnp.bool_ else jnp.all(g, 0),
    "or": lambda g: jnp.bitwise_or.reduce(g, axis=0) if g.dtype != jnp.bool_ else jnp.any(g, 0),
}
REDUCE_TYPES = tuple(_PRIMITIVES) + tuple(_GATHERED)


@functools.cache
def mesh():
    """The mesh of replicas: each process's first device, in process order."""
    first = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return jax.sharding.Mesh(np.array([first[p] for p in sorted(first)]), (AXIS,))


def _local_array(t: torch.Tensor):
    """``t``'s value as a single-device ``jax.Array`` on this process's device (runs pending
    work first), with at least one dimension."""
    if api.is_view(t):
        t = t.clone()
    with capture.set_aside("replica collective"):  # torch_xla.compile(full_graph=True) lets it
        array = api.array(t)
    local = array.addressable_data(0)
    return local.reshape(1) if local.ndim == 0 else local


def _global(local, n: int):
    shape = (local.shape[0] * n,) + tuple(local.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh(), P(AXIS)), [local])


class _Program:
    """A cached collective over given shapes and dtypes: ``run(locals) -> locals``.

    ``params`` are the collective's settings (see ``_BODIES``). The results of ``all_reduce``,
    ``all_gather`` and ``collective_broadcast`` are the same on every replica; those of
    ``reduce_scatter``, ``all_to_all`` and ``collective_permute`` are each replica's own block.
    """

    def __init__(self, kind: str, params: tuple, signature: tuple):
        self.kind = kind
        n = len(signature)
        make_body, replicated = _BODIES[kind]
        out = P() if replicated else P(AXIS)
        mapped = jax.shard_map(functools.partial(make_body, *params), mesh=mesh(),
                               in_specs=(P(AXIS),) * n, out_specs=(out,) * n, check_vma=False)
        self.fn = jax.jit(mapped, out_shardings=(NamedSharding(mesh(), out),) * n)
        text = f"{kind}|{params!r}|" + ";".join(f"{s}:{d}" for s, d in signature)
        self.digest = divergence.text_digest(text)
        sizes: dict = {}
        for shape, dtype in signature:
            sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(shape))
        tensors = f"{n} tensor{'s' if n != 1 else ''} (" + ", ".join(
            f"{size} {dtype} elements" for dtype, size in sizes.items()) + ")"
        self.what = _DESCRIPTIONS[kind](tensors, *params)

    def run(self, locals_: list) -> list:
        divergence.before_collective(self.digest, f"xm.{self.kind}", self.what)
        n = mesh().devices.size
        outs = self.fn(*[_global(x, n) for x in locals_])
        return [o.addressable_data(0) for o in outs]


# Tensors with fewer elements than this travel concatenated (see [Note: one collective for many
# tensors]); larger ones as operands of their own.
BUCKET_ELEMENTS = 1 << 16


def _reduce_body(op, scale, *xs):
    """One variadic reduction: small tensors concatenated per dtype, large ones as they are."""
    buckets: dict = {}
    operands, places = [], []  # places[j]: operand j's tensor index, or a bucket's indices
    for i, x in enumerate(xs):
        if x.size < BUCKET_ELEMENTS:
            buckets.setdefault(x.dtype, []).append(i)
        else:
            operands.append(x)
            places.append(i)
    for dtype, members in buckets.items():
        operands.append(jnp.concatenate([xs[i].reshape(-1) for i in members]))
        places.append(members)
    if op in _PRIMITIVES:
        reduced = _PRIMITIVES[op](tuple(operands))
    else:
        reduced = [_GATHERED[op](jax.lax.all_gather(x, AXIS)) for x in operands]
    outs = [None] * len(xs)
    for place, value in zip(places, reduced):
        if scale != 1.0:
            value = value * jnp.asarray(scale, value.dtype)
        if isinstance(place, int):
            outs[place] = value
            continue
        offset = 0
        for i in place:
            outs[i] = value[offset:offset + xs[i].size].reshape(xs[i].shape)
            offset += xs[i].size
    return tuple(outs)


def _gather_body(dim, *xs):
    return tuple(jax.lax.all_gather(x, AXIS, axis=dim, tiled=True) for x in xs)


def _scatter_body(op, scale, dims, *xs):
    """Each tensor reduced over the replicas, then split along its dim: this replica's block."""
    outs = []
    for x, dim in zip(xs, dims):
        if op == "sum":
            block = jax.lax.psum_scatter(x, AXIS, scatter_dimension=dim, tiled=True)
        else:
            whole = _PRIMITIVES[op](x) if op in _PRIMITIVES else \
                _GATHERED[op](jax.lax.all_gather(x, AXIS))
            size = x.shape[dim] // jax.lax.axis_size(AXIS)
            block = jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(AXIS) * size, size,
                                                 axis=dim)
        outs.append(block * jnp.asarray(scale, block.dtype) if scale != 1.0 else block)
    return tuple(outs)


def _all_to_all_body(split, concat, *xs):
    return tuple(jax.lax.all_to_all(x, AXIS, split, concat, tiled=True) for x in xs)


def _permute_body(pairs, *xs):
    return tuple(jax.lax.ppermute(x, AXIS, perm=pairs) for x in xs)


def _broadcast_body(root, *xs):
    return tuple(jax.lax.all_gather(x, AXIS)[root] for x in xs)


# kind: (body(*params, *locals), whether every replica gets the same result)
_BODIES = {
    "all_reduce": (_reduce_body, True),  # params: (op, scale)
    "all_gather": (_gather_body, True),  # (dim,)
    "reduce_scatter": (_scatter_body, False),  # (op, scale, dim per tensor)
    "all_to_all": (_all_to_all_body, False),  # (split dim, concat dim)
    "collective_permute": (_permute_body, False),  # ((source, target) pairs,)
    "collective_broadcast": (_broadcast_body, True),  # (root,)
}
_DESCRIPTIONS = {  # what the multi-process check names (tensors: "2 tensors (...)")
    "all_reduce": lambda tensors, op, scale: f"{op!r} over {tensors}",
    "all_gather": lambda tensors, dim: f"{tensors} along dim {dim}",
    "reduce_scatter": lambda tensors, op, scale, dims: f"{op!r} over {tensors}, scattered "
                                                       f"along dims {list(dims)}",
    "all_to_all": lambda tensors, split, concat: f"{tensors}, split along dim {split}, "
                                                 f"concatenated along dim {concat}",
    "collective_permute": lambda tensors, pairs: f"{tensors}, pairs {list(pairs)}",
    "collective_broadcast": lambda tensors, root: f"{tensors} from replica {root}",
}


_PROGRAMS: dict = {}


def _program(kind: str, params: tuple, signature: tuple) -> _Program:
    # Exact key: strings, ints, floats, tuples of ints, shapes as tuples of ints, dtypes as numpy
    # dtype names.
    key = (kind, params, signature)
    program = _PROGRAMS.get(key)
    if program is None:
        program = _PROGRAMS[key] = _Program(kind, params, signature)
    return program


def _signature(locals_: list) -> tuple:
    return tuple((tuple(int(d) for d in x.shape), str(x.dtype)) for x in locals_)


def run(kind: str, params: tuple, tensors: list, shapes: list) -> list:
    """Collective ``kind`` (see ``_BODIES``) over ``tensors``: this replica's results, data nodes
    (IR) of the given ``shapes``, one per tensor."""
    locals_ = [_local_array(t) for t in tensors]
    results = _program(kind, params, _signature(locals_)).run(locals_)
    return [_node(r, shape, t.dtype) for r, shape, t in zip(results, shapes, tensors)]


def all_reduce(op: str, tensors: list, scale: float) -> list:
    """The reduction of each tensor across the replicas, times ``scale``: data nodes (IR) with
    the results, one per tensor."""
    return run("all_reduce", (op, float(scale)), tensors, [t.shape for t in tensors])


def all_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The replicas' values of ``t`` (at least 1-dim) concatenated along ``dim`` (>= 0), in
    replica order."""
    shape = list(t.shape)
    shape[dim] *= mesh().devices.size
    (result,) = run("all_gather", (dim,), [t], [shape])
    return api.new_tensor(result)


def _node(result, shape, dtype: torch.dtype):
    shape = tuple(shape)
    if result.shape != shape:  # a 0-dim value travelled as shape (1,)
        result = result.reshape(shape)
    return api.data_node(result, shape, dtype)


# -- host objects ----------------------------------------------------------------------------------


class RendezvousMismatchError(RuntimeError):
    """The replicas met at a rendezvous with different tags."""


def exchange_objects(tag: str, payload) -> list:
    """Every replica's ``payload`` (picklable), in replica order; every replica must call it with
    the same ``tag``."""
    import torch.distributed as dist

    from xshard.core import distributed, divergence

    if not dist.is_initialized():
        raise RuntimeError("the replicas have no torch.distributed group; they are started by "
                           "xmp.spawn, which creates one (xshard.initialize()).")
    # Every replica arrives first, through the same check as device collectives: one that
    # returned, failed or went elsewhere is an error naming it within XSHARD_SYNC_TIMEOUT, where
    # gloo's all-gather would wait for it until JAX's coordination service aborted the process.
    # The tags are compared after the gather (a mismatch names both).
    divergence.before_collective("rendezvous", "rendezvous", repr(tag))
    gathered: list = [None] * distributed.num_processes()
    dist.all_gather_object(gathered, (tag, payload))
    tags = [g[0] for g in gathered]
    if len(set(tags)) > 1:
        where = "; ".join(f"process {p}: {t!r}" for p, t in enumerate(tags))
        raise RendezvousMismatchError(
            f"the replicas met at rendezvous with different tags ({where}). Every replica must "
            f"call xm.rendezvous / xm.mesh_reduce / xm.save with the same tag in the same order.")
    return [g[1] for g in gathered]
