"""Rules of xshard's own ops (the list and their meaning: xshard.core.ir)."""

from __future__ import annotations

import dataclasses

import torch

from xshard.core import ir, runtime
from xshard.core.lowering.table import RULES, apply_rule, weak_typed
from xshard.core.padding import pad_array

jax = runtime.jax_module()
jnp = jax.numpy
lax = jax.lax
import jax.extend.random as jax_random  # noqa: E402


def _rng_key(seed, counter):
    """Threefry key data (uint32[2]) for the draw at ``counter`` of the stream seeded ``seed``
    (both uint64): one threefry hash of the counter's two halves under the seed's two halves as
    the key, so a draw's key is a function of (seed, counter) alone, whichever graph it is in.
    (Three ``fold_in``s, as before, cost three hashes per random op: XLA compiled a graph of 100
    random ops in twice the time.)"""
    def halves(x):
        x = lax.convert_element_type(x, jnp.uint64)
        return (lax.convert_element_type(x >> 32, jnp.uint32),
                lax.convert_element_type(x & 0xFFFFFFFF, jnp.uint32))

    return jax_random.threefry_2x32(halves(seed), jnp.stack(halves(counter)))


def _constrain(x, sharding):
    return lax.with_sharding_constraint(x, sharding)


def _shard_output(x, padded_shape, sharding):
    return lax.with_sharding_constraint(pad_array(x, padded_shape), sharding)


def _partial_sum(rows, sharding):
    return jnp.sum(lax.with_sharding_constraint(rows, sharding), axis=0)


def _scattered_sum(rows, sharding):
    axes = sharding.spec[0]
    spec = jax.sharding.PartitionSpec(axes)

    def body(block):  # this device's row: (1, n, ...) -> its block of the sum, (1, ...)
        return lax.psum_scatter(block[0], axes, scatter_dimension=0, tiled=True)

    return jax.shard_map(body, mesh=sharding.mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(rows)


STACKED = "rows"  # a PER_DEVICE input mode: already one row per device (vmapped over dim 0)


@dataclasses.dataclass(frozen=True)
class PerDeviceCall:
    """What a ``PER_DEVICE`` node runs per block: the original op and its static arguments (kept
    whole: the graph fills only the outer template's slots)."""

    op: object
    template: tuple = dataclasses.field(compare=False)
    exact_template: tuple  # what equality compares (see [Note: exact keys] in xshard.core.ir)
    modes: tuple  # per input: None (shared), STACKED, or the dimension to split into blocks
    index: int | None  # the output taken from a multi-output op
    shape: tuple  # one block's result
    dtype: torch.dtype
    n: int


def per_device_call(op, template, modes, index, shape, dtype, n) -> PerDeviceCall:
    return PerDeviceCall(op, template, ir.exact(template), tuple(modes), index, tuple(shape),
                         dtype, n)


def _per_device(call: PerDeviceCall, *xs):
    rule = RULES[call.op]
    n = call.n
    ins, axes = [], []
    for x, mode in zip(xs, call.modes):
        if mode is None:
            axes.append(None)
        elif mode == STACKED:
            axes.append(0)
        else:  # split dimension ``mode`` into n blocks, the block index leading
            x = x.reshape(x.shape[:mode] + (n, x.shape[mode] // n) + x.shape[mode + 1:])
            x = jnp.moveaxis(x, mode, 0)
            axes.append(0)
        ins.append(x)

    def one(*vals):
        if call.index is None:
            return apply_rule(call.op, rule, call.template, vals, call.shape, call.dtype)
        outputs = [None] * (call.index + 1)
        outputs[call.index] = (call.shape, call.dtype)
        return apply_rule(call.op, rule, call.template, vals, None, None,
                          tuple(outputs))[call.index]

    return jax.vmap(one, in_axes=tuple(axes))(*ins)


def _first_row(x, n):
    return jnp.zeros((n, *x.shape), x.dtype).at[0].set(x)


def _barrier(*values):
    return tuple(lax.optimization_barrier(tuple(values)))


class ManualRegionError(RuntimeError):
    pass


def _manual_enter(x, spec):
    raise ManualRegionError(
        "a value from enable_manual_sharding was used outside its region; close the region with "
        "disable_manual_sharding before using the result in global computations.")


# A closed region's program (a ``Program`` over its subgraph) under the region graph's exact key:
# the MANUAL_REGION node carries the key, so equal regions share one entry and one executable.
REGION_PROGRAMS: dict = {}


def _manual_region(operands, key, in_specs, out_specs, mesh):
    body = jax.shard_map(REGION_PROGRAMS[key], mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs, check_vma=False)
    return body(*operands)


def _all_reduce(x, names, op):
    reduce = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}[op]
    return reduce(x, names)


RULES.update({
    ir.RNG_KEY: _rng_key,
    ir.WEAK: weak_typed,
    ir.CONSTRAIN: _constrain,
    ir.SHARD_OUTPUT: _shard_output,
    ir.PARTIAL_SUM: _partial_sum,
    ir.SCATTERED_SUM: _scattered_sum,
    ir.PER_DEVICE: _per_device,
    ir.FIRST_ROW: _first_row,
    ir.BARRIER: _barrier,
    ir.CSE_BARRIER: _barrier,
    ir.MANUAL_ENTER: _manual_enter,
    ir.MANUAL_REGION: _manual_region,
    ir.ALL_REDUCE: _all_reduce,
    ir.ALL_GATHER: lambda x, names, dim: lax.all_gather(x, names, axis=dim, tiled=True),
    ir.REDUCE_SCATTER: lambda x, names, dim: lax.psum_scatter(x, names, scatter_dimension=dim,
                                                              tiled=True),
    ir.ALL_TO_ALL: lambda x, names, split, concat: lax.all_to_all(x, names, split, concat,
                                                                  tiled=True),
    ir.PPERMUTE: lambda x, name, perm: lax.ppermute(x, name, perm),
})
