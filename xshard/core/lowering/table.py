"""The lowering table itself: aten overload (or xshard op name) -> rule."""

from __future__ import annotations

import functools

import numpy as np
import torch

from xshard.core import runtime
from xshard.core.dtypes import to_numpy_dtype
from xshard.core.ir import Slot

jnp = runtime.jax_module().numpy
lax = runtime.jax_module().lax
from jax._src.lax import lax as _lax_internal  # noqa: E402

RULES: dict = {}


def rule(*ops):
    """Registers the decorated function as the rule of ``ops`` (a packet: all its overloads not
    registered yet)."""
    def register(fn):
        for op in ops:
            if isinstance(op, torch._ops.OpOverloadPacket):
                for name in op.overloads():
                    RULES.setdefault(getattr(op, name), fn)
            else:
                RULES[op] = fn
        return fn
    return register


# [Note: combining scatters over uneven shardings]
# XLA's SPMD partitioner (jaxlib 0.10.2) pads an index array sharded unevenly over part of a mesh
# (a dim of 5 over the 4-device axis of a 2x4 mesh, replicated over the other axis) and lets the
# padding take part in a combining scatter: each padded slot holds index 0 and an update, so element
# 0 gains one update per slot. ``zeros(6).at[idx5].add(ones(5))`` with idx5 constrained to P("b")
# gives [3, 1, 1, 1, 1, 1] in plain JAX. Setting scatters, gathers, 1-D meshes and the whole mesh on
# one dim are right. It reaches scatter_add / scatter_reduce / index_add / index_put(accumulate) and
# the backward of embedding, gather, indexing, cummax and max pooling. So the combining scatters go
# through ``combine``: when an index or update array has a dim that the program's device count does
# not divide (a sharding of it might be uneven), both are replicated first. Shapes that divide are
# untouched (no cost in the usual training step); the rest pay one all-gather of their indices and
# updates. tests/spmd/test_scatter.py has the cases, against eager.
# The replicated sharding of the program being traced, if sharded; the float dtype of the node
# being lowered when its result is float64, else float32 (see ``float_dtype``).
PROGRAM = {"replicated": None, "float": np.dtype(np.float32)}
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def float_dtype():
    """The dtype a rule computes integers (or Python numbers alone) in where PyTorch's result is a
    float of the default dtype (``int_tensor / 3``, ``int_tensor.sqrt()``, ``n / 2`` of numbers in
    a compiled step): float64 when the node's result is float64 (the default dtype is float64, or
    the numbers are Python's), else float32. Computed in float32 and cast, a float64 result would
    be float32's value."""
    return PROGRAM["float"]


def combine(x, idx, values, how: str):
    """``x.at[idx].<how>(values)`` (``how``: add, multiply, max, min), safe from the partitioner's
    padding (see [Note: combining scatters over uneven shardings])."""
    replicated = PROGRAM["replicated"]
    if replicated is not None:
        arrays = [a for a in (idx if isinstance(idx, tuple) else (idx,)) if hasattr(a, "shape")]
        if hasattr(values, "shape"):
            arrays.append(values)
        n = len(replicated.device_set)
        if any(d % n for a in arrays for d in a.shape):
            constrain = functools.partial(lax.with_sharding_constraint, shardings=replicated)
            idx = tuple(constrain(a) if hasattr(a, "shape") else a for a in idx) \
                if isinstance(idx, tuple) else constrain(idx)
            values = constrain(values) if hasattr(values, "shape") else values
    return getattr(x.at[idx], how)(values)


def astype(x, dtype):
    """``x`` as ``dtype``. A bool array becomes a number through a select, not a convert: XLA's
    algebraic simplifier rewrites ``convert(pred) * y`` and ``convert(pred) / y`` as
    ``select(pred, y or 1/y, 0)``, which gives 0 where PyTorch gives NaN (``False * inf``,
    ``False / False``)."""
    dtype = np.dtype(dtype)
    if x.dtype == np.bool_ and dtype != np.bool_:
        return jnp.where(x, jnp.ones((), dtype), jnp.zeros((), dtype))
    return x.astype(dtype)


HALF_FLOATS = (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def is_weak(x) -> bool:
    """A Python number, or an array standing for one (weakly typed: it promotes as a number)."""
    return getattr(x, "weak_type", False) or isinstance(x, (bool, int, float, complex))


def weak_typed(x):
    """``x`` weakly typed: JAX, and the rules (``is_weak``), promote it as a Python number."""
    return _lax_internal._convert_element_type(x, weak_type=True)


def in_float32(fn):
    """``fn`` computed in float32 when its floating-point arrays are all of one 16-bit dtype, each
    result rounded back to it once: ATen's CPU kernels compute 16-bit floats so ("opmath"), where
    XLA would round after every operation of a composite (sigmoid, GELU, softmax)."""
    def lower(*args, **kwargs):
        # A Python number (a weakly typed scalar: ``alpha`` of elu) takes the arrays' dtype.
        floats = {a.dtype for a in args if hasattr(a, "dtype") and not is_weak(a)
                  and jnp.issubdtype(a.dtype, jnp.floating)}
        if len(floats) != 1 or next(iter(floats)) not in HALF_FLOATS:
            return fn(*args, **kwargs)
        half = floats.pop()
        out = fn(*[a.astype(np.float32) if getattr(a, "dtype", None) == half else a
                   for a in args], **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_round_back(o, half) for o in out)
        return _round_back(out, half)
    return lower


def keep_nan(out, x, axis=None, keepdims=False):
    """``out``, a max or min of ``x`` over ``axis``, NaN where the elements reduced hold a NaN, as
    in ATen. XLA's reduction keeps a NaN on one device, but the all-reduce the SPMD partitioner
    adds over a sharded dim drops it on the CPU backend (plain JAX too, jaxlib 0.10.2), with the
    rest of that device's elements: the max of [0, nan, 2, ..., 8] over 8 devices gave 8.0 and its
    min 2.0. The NaN test is one more reduction XLA fuses with the first."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return out
    return jnp.where(jnp.isnan(x).any(axis=axis, keepdims=keepdims), jnp.nan, out)


def _round_back(x, half):
    return x.astype(half) if getattr(x, "dtype", None) == np.float32 else x


def has_rule(op) -> bool:
    return op in RULES


def np_dtype(dtype: torch.dtype):
    return to_numpy_dtype(dtype)


class LoweringError(RuntimeError):
    """A rule failed, or returned a value PyTorch's meta kernel says it cannot be."""


def thaw(x, args):
    """Static template ``x`` with each ``Slot`` replaced by its argument."""
    if type(x) is Slot:
        return args[x.index]
    if type(x) is tuple:
        return tuple([thaw(v, args) for v in x])
    return x


def apply_rule(op, rule, template, args, shape, dtype, outputs=None):
    """Calls ``rule`` on ``args`` (jax values, one per input slot) with ``template``'s static
    arguments; the result conformed to ``shape``/``dtype`` (or per ``outputs`` of a multi-output
    op)."""
    targs, tkwargs = template
    PROGRAM["float"] = _F64 if dtype is not None and to_numpy_dtype(dtype) == _F64 else _F32
    try:
        out = rule(*thaw(targs, args), **{k: thaw(v, args) for k, v in tkwargs})
    except LoweringError:
        raise
    except Exception as e:
        raise LoweringError(f"lowering {op} failed: {type(e).__name__}: {e}") from e
    if outputs is None:
        return conform(out, shape, dtype, op)
    if not isinstance(out, (tuple, list)) or len(out) < len(outputs):
        raise LoweringError(f"the rule of {op} returned {type(out).__name__} where PyTorch has "
                            f"{len(outputs)} outputs")
    return tuple(None if meta is None or o is None else conform(o, meta[0], meta[1], op)
                 for o, meta in zip(out, outputs))


def conform(x, shape, dtype, op):
    """``x`` as PyTorch's meta kernel describes the result: exactly ``shape``, and ``dtype``.

    A rule may compute in another dtype (JAX's promotion where PyTorch's differs, or integer
    results computed in floating point): the result is cast to ``dtype``. A result of another
    shape is a bug in the rule, and so is a complex result where PyTorch's is real (the cast would
    drop the imaginary part): either raises, naming the op.
    """
    x = jnp.asarray(x)
    if tuple(x.shape) != tuple(shape):
        raise LoweringError(
            f"the rule of {op} produced shape {tuple(x.shape)}, PyTorch expects {tuple(shape)}")
    want = to_numpy_dtype(dtype)
    if x.dtype != want:
        if jnp.issubdtype(x.dtype, jnp.complexfloating) and \
                not jnp.issubdtype(want, jnp.complexfloating):
            raise LoweringError(
                f"the rule of {op} produced {x.dtype}, PyTorch expects {want}: a cast would drop "
                f"the imaginary part")
        x = astype(x, want)
    return x
