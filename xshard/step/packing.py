"""Packed state: a replayed step passes the state it updates as a few large arrays, not one per tensor,
and its constant numbers not at all.

[Note: packed state]
Calling an executable costs host time per argument and per shard of it (JAX's C++ dispatch checks
each array's placement and hands each buffer to PJRT): a GPT step with AdamW reads and writes 84
state arrays, which on 8 CPU devices costs about 0.5-1 ms per call, in pure JAX as well. A step
that consumes an array and writes the new value back to the same place, with the same shape, dtype
and layout (parameters, optimizer moments, running stats), can as well keep it between calls as a
slice of a larger array. So from its first replay on, a program that passes at least
``MIN_PACKED`` fewer arrays so (counting [Note: numbers built into a replay]) runs a second
executable, the replay executable, compiled once for it: the same graph between an unpacking
prologue and a packing epilogue, taking one array per group of state arrays that share a dtype and
a device grid (replicated, or one dimension split into equal blocks over axes of one mesh; see
``grid``). A group's array is ``(blocks, L)``, split by rows: row ``b`` is, flattened, every
member's block ``b``. Packing and unpacking move no data between devices (the partitioner adds no
collective), but the epilogue writes each member once more: XLA does not fuse a concatenation into
the updates feeding it (a chain of in-place dynamic-update-slices is worse: XLA copies the
buffer). So only arrays whose blocks are at most ``MAX_PACKED_BYTES`` are packed, where the copy
costs less than the dispatch it saves; large weights stay arguments of their own. Measured (small
GPT, 8 CPU devices): packing every array cost 14% more bytes accessed on the (4, 2) mesh and made
the step 1.15x JAX's; with the bound, 54 of 84 arrays are packed and the step is as fast as
unpacked.

The tensors of the state then hold ``PackedData`` nodes (xshard.core.ir): data nodes that know
their layout but hold no array of their own until one is read. The first read of a member cuts
out every member of its pack with one cached program (``Layout.unpack``), into each member's node,
and lets the packed array go; the next call packs the members anew (``Layout.pack``), as it does
at the first replay or when a slot holds another node (a parameter loaded in between).

A packed array is donated to the next call. A member's node that something besides its storage
holds (a tensor sharing its data, a pending lazy computation) must keep its value, so the call
packs anew instead, which cuts the old pack first. When the call passed the pack as it was (every
member's node held by its storage alone), the nodes themselves move to the new pack, and each
storage counts a write: nothing else can see the old value, so no node is made, written or freed
per member (about 0.13 ms of host time per call of the small GPT on 8 CPU devices, where each is a
cold cache miss).

[Note: numbers built into a replay]
The recording passes every number of the step as a 0-d input, as a lazy sync does (so that one
executable serves every value): the optimizer's hyper-parameters, the constants of the model's
arithmetic, the random stream's seed and each draw's counter. To a replay most of them never
change: a hyper-parameter that changes records the step again (the guard compares them), and only
the learning rate is an input by design (see optim.py). Each one passed costs as much as a state
array (a small GPT with AdamW and dropout: 18 constants and 4 stream numbers, each a buffer per
device). So the replay executable, compiled with the packs (and for them when there are enough),
builds the constants into the program as literals, and reads the stream's numbers from one
``(seed, counter)`` array: the seed, and ``counter + k`` for the draw made ``k`` draws after the
step began, wrapping as the host's 64-bit counter does. The numbers are the plain program's (the
same dtypes, weak types kept); XLA may now fold arithmetic among constants when it compiles, which
the tests compare with the lazy path (a GPT step with dropout gives the same losses to the bit).
Measured on the small GPT (FSDP, 8 CPU devices; 27 arrays per call instead of 48): the executable
call took 0.22 ms of host time instead of 0.36 ms in a loop of 10 calls between waits, 0.21 instead
of 0.23-0.27 ms in bench_compile.py's rounds of 5 (where the devices are less busy during a call).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from xshard.core import compiler, rng, runtime, trace

# A replay executable passing fewer arrays less than this than the plain one is not worth a second
# compilation (a call costs about 12 us per array of 8 shards on CPU; see [Note: packed state]).
MIN_PACKED = 16
# Arrays with larger blocks per device stay unpacked: packing writes each member once more (XLA
# does not fuse the concatenation into the update), which costs more than it saves above this.
MAX_PACKED_BYTES = 16 * 1024


class Member:
    """One state array in a pack: where it enters and leaves the program and how it is cut."""

    __slots__ = ("input", "output", "shape", "dtype", "sharding", "dim", "offset", "size")

    def __init__(self, input, output, shape, dtype, sharding, dim, blocks):
        self.input, self.output = input, output
        self.shape, self.dtype, self.sharding, self.dim = tuple(shape), dtype, sharding, dim
        self.size = math.prod(shape) // blocks
        self.offset = 0

    def cut(self, packed, blocks: int):
        """This member's array (global shape) from a packed ``(blocks, L)`` array (traced)."""
        jnp = runtime.jax_module().numpy
        x = packed[:, self.offset:self.offset + self.size]
        if self.dim is None:
            return x.reshape(self.shape)
        k, shape = self.dim, self.shape
        local = shape[:k] + (shape[k] // blocks,) + shape[k + 1:]
        x = jnp.moveaxis(x.reshape((blocks,) + local), 0, k)
        return x.reshape(shape)

    def flat(self, x, blocks: int):
        """``x`` (this member's global shape) as ``(blocks, size)``: row b its block b (traced)."""
        jnp = runtime.jax_module().numpy
        if self.dim is None:
            return x.reshape(1, self.size)
        k, shape = self.dim, self.shape
        x = x.reshape(shape[:k] + (blocks, shape[k] // blocks) + shape[k + 1:])
        return jnp.moveaxis(x, k, 0).reshape(blocks, self.size)


class Layout:
    """One packed array: members of one dtype on one device grid, in order."""

    __slots__ = ("dtype", "blocks", "sharding", "members", "_unpack", "_pack")

    def __init__(self, dtype, blocks: int, sharding, members: list[Member]):
        self.dtype, self.blocks, self.sharding, self.members = dtype, blocks, sharding, members
        offset = 0
        for m in members:
            m.offset = offset
            offset += m.size
        self._unpack = self._pack = None

    def cut_all(self, packed) -> list:
        return [self.constrained(m.cut(packed, self.blocks), m.sharding) for m in self.members]

    def join(self, arrays):
        jnp = runtime.jax_module().numpy
        packed = jnp.concatenate([m.flat(a, self.blocks) for m, a in zip(self.members, arrays)],
                                 axis=1)
        return self.constrained(packed, self.sharding)

    @staticmethod
    def constrained(x, sharding):
        return runtime.jax_module().lax.with_sharding_constraint(x, sharding)

    def unpack(self, packed) -> list:
        """The members' arrays, cut out of ``packed`` (one cached program)."""
        if self._unpack is None:
            def xshard_unpack_state(packed):  # the program's name in profiles
                return self.cut_all(packed)

            self._unpack = runtime.jax_module().jit(
                xshard_unpack_state, out_shardings=[m.sharding for m in self.members])
        return list(self._unpack(packed))

    def pack(self, arrays):
        """One packed array from the members' arrays (one cached program; they are kept)."""
        if self._pack is None:
            def xshard_pack_state(*arrays):
                return self.join(arrays)

            self._pack = runtime.jax_module().jit(xshard_pack_state, out_shardings=self.sharding)
        return self._pack(*arrays)


class Pack:
    """A packed array as a step stored it, and weak references to its members' nodes."""

    __slots__ = ("array", "layout", "nodes")

    def __init__(self, array, layout: Layout):
        self.array, self.layout, self.nodes = array, layout, ()

    def hold(self, nodes) -> None:
        """``nodes`` (``PackedData``, in member order) are the members' nodes."""
        self.nodes = list(map(weakref.ref, nodes))

    def member(self, index: int):
        """Member ``index``'s array: the first read cuts every member out into its node and lets
        the packed array go (the next call packs the members again)."""
        arrays = self.layout.unpack(self.array)
        for ref, array in zip(self.nodes, arrays):
            node = ref()
            if node is not None:
                node.payload = array
        self.array, self.nodes = None, ()
        return arrays[index]


def grid(shape, sharding):
    """``(key, blocks, dim, packed sharding)`` when ``sharding`` replicates an array of ``shape``
    or splits one dimension ``dim`` of it into ``blocks`` equal blocks over axes of its mesh, else
    None. The packed sharding lays ``(blocks, L)`` out over the same devices, in the same order."""
    jax = runtime.jax_module()
    P = jax.sharding.PartitionSpec
    if not shape or math.prod(shape) == 0:
        return None
    if sharding.is_fully_replicated:
        devices = tuple(sharding._device_assignment)  # jit needs the same order for all arguments
        mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("copies",))
        return (devices,), 1, None, jax.sharding.NamedSharding(mesh, P())
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    split = [k for k, axes in enumerate(spec) if axes is not None]
    if len(split) != 1:
        return None
    k = split[0]
    axes = spec[k] if isinstance(spec[k], tuple) else (spec[k],)
    blocks = math.prod(sharding.mesh.shape[a] for a in axes)
    if shape[k] % blocks:
        return None
    return (sharding.mesh, axes), blocks, k, jax.sharding.NamedSharding(sharding.mesh, P(axes))


def plan(values, out_arrays, pairs) -> list[Layout]:
    """The packs of a program: ``pairs`` are ``(input, output)`` positions of state the program
    consumes and writes back in place; ``values`` and ``out_arrays`` its inputs and outputs of one
    call. A pair packs when both arrays have one shape, dtype and layout on a grid (see ``grid``)."""
    groups: dict = {}
    for p, q in pairs:
        a, b = values[p], out_arrays[q]
        if a.shape != b.shape or a.dtype != b.dtype:
            continue
        if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            continue
        g = grid(a.shape, a.sharding)
        if g is None:
            continue
        key, blocks, dim, packed = g
        if math.prod(a.shape) // blocks * np.dtype(a.dtype).itemsize > MAX_PACKED_BYTES:
            continue
        entry = groups.setdefault((np.dtype(a.dtype), key), (blocks, packed, []))
        entry[2].append(Member(p, q, a.shape, a.dtype, b.sharding, dim, blocks))
    # A pack of one array saves no argument and copies its member once more.
    return [Layout(dtype, blocks, packed, members)
            for (dtype, _), (blocks, packed, members) in groups.items() if len(members) > 1]


class Packed:
    """A program's replay executable: how its arguments and results map to the plain one's (see
    [Note: packed state] and [Note: numbers built into a replay])."""

    def __init__(self, layouts: list[Layout], n_inputs: int, n_outputs: int, fixed: dict,
                 stream: list):
        self.layouts = layouts
        # Input position -> the 0-d numpy array built in; (input position, offset or None, dtype)
        # of each number of the random stream, all read from one array passed last.
        self.fixed, self.stream = fixed, stream
        packed_in = {m.input for layout in layouts for m in layout.members}
        packed_out = {m.output for layout in layouts for m in layout.members}
        taken = packed_in | set(fixed) | {p for p, _, _ in stream}
        # The plain program's inputs and outputs passed as they are, in order, after the packs.
        self.inputs = [p for p in range(n_inputs) if p not in taken]
        self.outputs = [q for q in range(n_outputs) if q not in packed_out]
        self.n_outputs = n_outputs
        self.compiled = None

    @staticmethod
    def saves(layouts: list[Layout], fixed: dict, stream: list) -> int:
        """How many fewer arrays a call passes."""
        return sum(len(layout.members) - 1 for layout in layouts) + len(fixed) + max(
            len(stream) - 1, 0)

    @staticmethod
    def stream_array(seed: int, counter: int):
        """The random stream's position as the replay executable's last argument."""
        return np.array([seed, counter & rng.MASK], np.uint64)

    def compile(self, inner, options: dict, packs, values, stream, donate, compiled,
                name: str) -> None:
        """Compiles the replay executable around ``inner`` (the plain program's traced function,
        compiled as ``compiled`` with XLA ``options``): ``packs``, the other ``values`` and
        ``stream`` (the stream array, or None) are one call's arguments, ``donate`` the plain
        program's consumed inputs."""
        jax = runtime.jax_module()
        jnp = jax.numpy
        layouts, rest_in, rest_out = self.layouts, self.inputs, self.outputs
        fixed, numbers = self.fixed, self.stream
        n_packs, n_in, n_rest = len(layouts), len(values), len(rest_in)

        def step(*args):
            inputs = [None] * n_in
            for layout, packed in zip(layouts, args[:n_packs]):
                for m, x in zip(layout.members, layout.cut_all(packed)):
                    inputs[m.input] = x
            for p, x in zip(rest_in, args[n_packs:n_packs + n_rest]):
                inputs[p] = x
            for p, value in fixed.items():
                inputs[p] = jnp.asarray(value)
            if numbers:
                seed, counter = args[-1][0], args[-1][1]
                for p, offset, dtype in numbers:  # uint64 sums wrap as the host's mask does
                    x = seed if offset is None else counter + np.uint64(offset & rng.MASK)
                    inputs[p] = x.astype(dtype)
            outs = inner(*inputs)
            joined = tuple(layout.join([outs[m.output] for m in layout.members])
                           for layout in layouts)
            return joined + tuple(outs[q] for q in rest_out)

        with trace.naming(name):
            step.__name__ = trace.program_name()
        in_shardings, out_shardings = compiled.input_shardings[0], compiled.output_shardings
        packed_shardings = tuple(layout.sharding for layout in layouts)
        # The stream's array is placed as its numbers were.
        stream_sharding = (in_shardings[numbers[0][0]],) if numbers else ()
        jitted = jax.jit(
            step,
            in_shardings=packed_shardings + tuple(in_shardings[p] for p in rest_in) +
            stream_sharding,
            out_shardings=packed_shardings + tuple(out_shardings[q] for q in rest_out),
            donate_argnums=tuple(range(n_packs)) + tuple(
                n_packs + k for k, p in enumerate(rest_in) if p in set(donate)))
        with trace.phase(trace.COMPILE):
            lowered = jitted.lower(*packs, *(values[p] for p in rest_in),
                                   *(() if stream is None else (stream,)))
            self.compiled = compiler.compile_lowered(lowered, options)

    def results(self, out) -> tuple[list, list]:
        """The packed arrays and the plain program's results (None where packed) of ``out``."""
        n_packs = len(self.layouts)
        results = [None] * self.n_outputs
        for q, array in zip(self.outputs, out[n_packs:]):
            results[q] = array
        return list(out[:n_packs]), results
