"""Random program generation for the differential test (see [Note: differential programs]).

A program grows one step at a time. Each step comes from a *family*: a function that picks
operands among the values so far (eager CPU tensors, so it sees shapes, dtypes and which values
are views) and random static arguments for one op (dims, negative and positive, indices, sizes,
scalars, dtypes, rounding modes...). The candidate runs eagerly; if PyTorch rejects it, another is
drawn. Families cover the ops of xshard's lowering table through PyTorch's public API:

- views (select, basic indexing, narrow, transpose, permute, view/reshape, expand, squeeze,
  diagonal, unbind/split/chunk, unfold, movedim, view as another dtype), and in-place writes
  through them (``add_``, ``copy_``, ``t[i] = v``, ``index_add_``, ``scatter_``, ``out=``...);
- elementwise, reductions and scans over dims, shape copies, factories, linear algebra;
- ``opinfo``: a sample input of an OpInfo of PyTorch's ``op_db`` (for the long tail: convolutions,
  pooling, losses, norms, special functions), its first tensor replaced by a value of the program
  when one has its shape and dtype, so OpInfo ops chain with the rest.
"""

from __future__ import annotations

import functools
import math
import random

import torch

from differential import (DEVICE, TIE_SENSITIVE, InvalidProgram, Ref, Step, n_values, settle)

# Drawn uniformly: float32, int64 and bool most often; uint8 (unsigned wrap-around, ordering),
# int32 and bfloat16 (promotion between narrow types, rounding) less.
DTYPES = (torch.float32, torch.float32, torch.int64, torch.int64, torch.bool, torch.bool,
          torch.uint8, torch.int32, torch.bfloat16)


# -- the generator's state -------------------------------------------------------------------------


class Gen:
    """A program being grown, with the eager values at its end."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.program: tuple = ()
        self.values: list = []
        self.pending: list = []  # input steps the next call needs

    # operands

    def pick(self, pred=None, prefer_views=False, recent=True):
        """A (Ref, eager value) of the program, or None; recent values and views favoured."""
        choices = [(i, v) for i, v in enumerate(self.values) if pred is None or pred(v)]
        if not choices:
            return None
        if prefer_views:
            views = [c for c in choices if c[1]._base is not None]
            if views and self.rng.random() < 0.7:
                choices = views
        if recent and self.rng.random() < 0.6:
            choices = choices[-3:]
        i, v = self.rng.choice(choices)
        return Ref(i), v

    def pick_or_fresh(self, pred=None, dtypes=DTYPES, **kw):
        got = self.pick(pred, **kw)
        if got is not None:
            return got
        for _ in range(10):
            shape = self.shape()
            dtype = self.rng.choice(dtypes)
            data = make_data(self.rng, shape, dtype)
            if pred is None or pred(data):
                return self.fresh_data(data), data
        return None

    def fresh_data(self, data: torch.Tensor) -> Ref:
        ref = Ref(n_values(self.program) + len(self.pending))
        self.pending.append(Step("input", data=data))
        return ref

    def fresh(self, shape, dtype) -> Ref:
        return self.fresh_data(make_data(self.rng, shape, dtype))

    def indices(self, shape, high: int, unique_dim=None) -> Ref:
        """A fresh int64 tensor of ``shape`` with values in [-high, high) (negative ones too), or
        in [0, high) and distinct along ``unique_dim``."""
        if unique_dim is None:
            g = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
            data = torch.randint(-high, high, tuple(shape), generator=g) if high else \
                torch.zeros(tuple(shape), dtype=torch.int64)
        else:
            data = unique_indices(self.rng, shape, high, unique_dim)
        return self.fresh_data(data)

    # static arguments

    def shape(self, ndim=None):
        ndim = self.rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4]) if ndim is None else ndim
        sizes = []
        for _ in range(ndim):
            r = self.rng.random()
            sizes.append(0 if r < 0.02 else 1 if r < 0.2 else self.rng.choice([2, 3, 3, 4, 5]))
        if ndim >= 2 and self.rng.random() < 0.3:  # square: dims -1 and -2 give equal shapes
            sizes[-2] = sizes[-1]
        return tuple(sizes)

    def dim(self, t, extra: int = 0):
        """A dim of ``t`` (of ``t.dim() + extra`` dims), negative half the time."""
        n = max(t.dim() + extra, 1)
        d = self.rng.randrange(n)
        return d - n if self.rng.random() < 0.5 else d

    def dims(self, t, allow_none=True, as_list=False):
        r = self.rng.random()
        if allow_none and r < 0.2:
            return None
        if r < 0.55 or t.dim() < 2:
            return self.dim(t)
        k = self.rng.randint(1, t.dim())
        picked = self.rng.sample(range(t.dim()), k)
        out = [d - t.dim() if self.rng.random() < 0.5 else d for d in picked]
        return out if as_list else tuple(out)

    def index_in(self, size: int) -> int:
        if size == 0:
            return 0
        i = self.rng.randrange(size)
        return i - size if self.rng.random() < 0.5 else i

    def scalar(self, dtype=None):
        dtype = dtype or self.rng.choice(DTYPES)
        if dtype == torch.bool:
            return self.rng.random() < 0.5
        if dtype.is_floating_point and self.rng.random() < 0.8:
            return self.rng.choice([0.5, -1.5, 2.0, -1.0, 0.25, 3.0, -2.0, 1.0])
        return self.rng.choice([-1, 2, 3, 0, -2, 1])

    def bool(self):
        return self.rng.random() < 0.5

    def other(self, t, allow_scalar=True, same_shape=False, dtypes=None):
        """A second operand broadcasting with ``t`` (to ``t``'s shape if ``same_shape``)."""
        r = self.rng.random()
        if allow_scalar and r < 0.3:
            return self.scalar(t.dtype if self.rng.random() < 0.7 else None)

        def fits(v):
            if dtypes is not None and v.dtype not in dtypes:
                return False
            try:
                out = torch.broadcast_shapes(v.shape, t.shape)
            except RuntimeError:
                return False
            return not same_shape or tuple(out) == tuple(t.shape)

        if r < 0.6:
            got = self.pick(fits)
            if got is not None:
                return got[0]
        shape = list(t.shape)
        if shape and self.rng.random() < 0.5:
            shape = shape[self.rng.randrange(len(shape)):]
        shape = [1 if self.rng.random() < 0.3 else s for s in shape]
        if not same_shape and shape and self.rng.random() < 0.15:
            shape = [1] + shape
        dtype = t.dtype if self.rng.random() < 0.7 else self.rng.choice(DTYPES)
        if dtypes is not None and dtype not in dtypes:
            dtype = self.rng.choice(dtypes)
        return self.fresh(tuple(shape), dtype)


def make_data(rng: random.Random, shape, dtype) -> torch.Tensor:
    """Distinct values (so no tie decides a sort), exact in float32: multiples of 1/4 around 0;
    now and then a NaN, infinity or -0.0 among floats."""
    n = math.prod(shape)
    perm = list(range(n))
    rng.shuffle(perm)
    if dtype == torch.bool:
        return torch.tensor([rng.random() < 0.5 for _ in range(n)], dtype=torch.bool).reshape(shape)
    if dtype.is_floating_point:
        values = [(p - n // 2) / 4 for p in perm]
        if n and rng.random() < 0.08:
            values[rng.randrange(n)] = rng.choice([math.nan, math.inf, -math.inf, -0.0])
        return torch.tensor(values, dtype=dtype).reshape(shape)
    if dtype == torch.uint8:  # around 0 too: the largest values stand for small negative ones
        return torch.tensor([(p - n // 2) % 256 for p in perm], dtype=dtype).reshape(shape)
    return torch.tensor([p - n // 2 for p in perm], dtype=dtype).reshape(shape)


def unique_indices(rng, shape, high, dim):
    """int64 indices in [0, high), distinct along ``dim`` (needs shape[dim] <= high)."""
    shape = tuple(shape)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if not shape:
        return torch.tensor(rng.randrange(max(high, 1)))
    moved = list(shape)
    n = moved.pop(dim)
    rows = [torch.randperm(high, generator=g)[:n] for _ in range(math.prod(moved))]
    out = torch.stack(rows) if rows else torch.zeros((0, n), dtype=torch.int64)
    return out.reshape(*moved, n).movedim(-1, dim).contiguous()


def _is_float(v):
    return v.dtype.is_floating_point


def _nonempty(v):
    return v.numel() > 0


def _call(kind, name, *args, **kwargs):
    return Step(kind, name, tuple(args), tuple(kwargs.items()), n_out=None)


def _optional_kwargs(g, **options):
    """Each keyword with probability one half: name -> value (callables are drawn)."""
    out = {}
    for k, v in options.items():
        if g.rng.random() < 0.5:
            out[k] = v() if callable(v) else v
    return out


# -- families --------------------------------------------------------------------------------------

FAMILIES: list = []


def family(weight: float):
    def register(fn):
        FAMILIES.append((weight, fn))
        return fn
    return register


def _basic_index(g, t):
    parts = []
    ellipsis = False
    dim = 0
    for _ in range(g.rng.randint(1, max(1, t.dim()) + 1)):
        r = g.rng.random()
        if r < 0.1 and not ellipsis:
            parts.append(Ellipsis)
            ellipsis = True
            dim = max(dim, t.dim() - (len(parts) - 1))  # remaining parts index from the end
            continue
        if r < 0.2:
            parts.append(None)
            continue
        if dim >= t.dim():
            break
        size = t.shape[dim]
        if r < 0.45 and size > 0:
            parts.append(g.index_in(size))
        else:
            def bound():
                return g.rng.choice([None, g.rng.randint(-size - 1, size + 1)])
            step = g.rng.choice([None, None, 1, 2, 3])
            parts.append(slice(bound(), bound(), step))
        dim += 1
    return parts[0] if len(parts) == 1 and g.rng.random() < 0.5 else tuple(parts)


@family(3.0)
def views(g):
    ref, t = g.pick(recent=True)
    r = g.rng
    choice = r.choice(["select", "getitem", "getitem", "narrow", "transpose", "permute", "view",
                       "reshape", "flatten", "unflatten", "expand", "unsqueeze", "squeeze",
                       "diagonal", "unbind", "split", "chunk", "movedim", "unfold", "t",
                       "view_dtype", "detach", "swapaxes"])
    if choice == "select" and t.dim():
        d = g.dim(t)
        return _call("method", "select", ref, d, g.index_in(t.shape[d]))
    if choice == "getitem":
        return Step("getitem", "getitem", (ref, _basic_index(g, t)), n_out=None)
    if choice == "narrow" and t.dim():
        d = g.dim(t)
        size = t.shape[d]
        start = r.randint(-size, size) if size else 0
        length = r.randint(0, max(size - start % max(size, 1), 0))
        return _call("method", "narrow", ref, d, start, length)
    if choice in ("transpose", "swapaxes"):
        return _call("method", choice, ref, g.dim(t), g.dim(t))
    if choice == "permute":
        dims = list(range(t.dim()))
        r.shuffle(dims)
        dims = [d - t.dim() if r.random() < 0.4 else d for d in dims]
        return _call("method", "permute", ref, *dims)
    if choice in ("view", "reshape"):
        return _call("method", choice, ref, *_reshape_target(g, t))
    if choice == "flatten":
        return _call("method", "flatten", ref, g.dim(t), g.dim(t))
    if choice == "unflatten" and t.dim():
        d = g.dim(t)
        size = t.shape[d]
        factors = [f for f in range(1, size + 1) if size % f == 0] or [1]
        f = r.choice(factors)
        sizes = (f, size // f) if r.random() < 0.6 else (-1, f) if f else (f, -1)
        return _call("method", "unflatten", ref, d, sizes)
    if choice == "expand":
        sizes = [r.choice([s, -1]) if s != 1 else r.choice([1, 2, 3, -1]) for s in t.shape]
        if r.random() < 0.3:
            sizes = [r.randint(1, 3)] + sizes
        return _call("method", "expand", ref, *sizes)
    if choice == "unsqueeze":
        return _call("method", "unsqueeze", ref, g.dim(t, extra=1))
    if choice == "squeeze":
        return _call("method", "squeeze", ref, *([] if r.random() < 0.3 else [g.dims(t, False)]))
    if choice == "diagonal" and t.dim() >= 2:
        return _call("method", "diagonal", ref, r.randint(-2, 2), g.dim(t), g.dim(t))
    if choice == "unbind":
        return _call("method", "unbind", ref, g.dim(t))
    if choice == "split" and t.dim():
        d = g.dim(t)
        return _call("method", "split", ref, r.randint(1, max(t.shape[d], 1)), d)
    if choice == "chunk" and t.dim():
        return _call("method", "chunk", ref, r.randint(1, 3), g.dim(t))
    if choice == "movedim" and t.dim():
        return _call("method", "movedim", ref, g.dim(t), g.dim(t))
    if choice == "unfold" and t.dim():
        d = g.dim(t)
        return _call("method", "unfold", ref, d, r.randint(1, max(t.shape[d], 1)), r.randint(1, 2))
    if choice == "t" and t.dim() <= 2:
        return _call("method", "t", ref)
    if choice == "view_dtype" and t.dtype == torch.float32:
        # (bool as uint8 is left out: writing 255 there makes a bool eager stores as 255)
        return _call("method", "view", ref, torch.int32)
    if choice == "detach":
        return _call("method", "detach", ref)
    return None


def _reshape_target(g, t):
    n = t.numel()
    r = g.rng
    if r.random() < 0.25:
        return [-1]
    sizes = []
    rest = n
    for _ in range(r.randint(0, 3)):
        factors = [f for f in range(1, rest + 1) if rest % f == 0] if rest else [0, 1]
        f = r.choice(factors)
        sizes.append(f)
        rest = rest // f if f else 0
    sizes.append(rest)
    r.shuffle(sizes)
    if r.random() < 0.4:
        sizes[r.randrange(len(sizes))] = -1
    return sizes


_UNARY = ["neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "floor",
          "ceil", "round", "trunc", "sign", "sgn", "logical_not", "bitwise_not", "isnan", "isinf",
          "isfinite", "square", "reciprocal", "erf", "expm1", "log1p", "frac", "signbit", "relu",
          "exp2", "log2", "atan", "asinh", "deg2rad", "positive", "special.ndtr", "lgamma",
          "erfinv", "acos", "cosh", "isneginf", "nn.functional.silu", "nn.functional.hardswish",
          "nn.functional.hardsigmoid", "nn.functional.mish", "nn.functional.relu6",
          "special.erfcx", "special.i0e", "special.i1", "special.i1e", "special.log_ndtr",
          "special.ndtri", "special.entr", "special.i0", "special.modified_bessel_i0",
          "special.modified_bessel_i1", "special.spherical_bessel_j0", "digamma", "sinc",
          "frexp", "angle", "atanh", "acosh", "asin", "tan", "sinh", "rad2deg", "log10", "erfc",
          "isposinf", "nn.functional.logsigmoid", "nn.functional.softsign",
          "nn.functional.tanhshrink"]


@family(2.0)
def unary(g):
    ref, t = g.pick()
    r = g.rng
    kind = r.random()
    if kind < 0.55:
        return _call("torch", r.choice(_UNARY), ref)
    f = r.choice(["gelu", "leaky_relu", "elu", "softplus", "hardtanh", "clamp", "round", "logit",
                  "pow", "nan_to_num", "threshold", "celu", "float_power_scalar", "clamp_min"])
    if f == "gelu":
        return _call("torch", "nn.functional.gelu", ref, **_optional_kwargs(
            g, approximate=lambda: r.choice(["none", "tanh"])))
    if f == "leaky_relu":
        return _call("torch", "nn.functional.leaky_relu", ref, r.choice([0.01, 0.2, -0.5, 2.0]))
    if f == "elu":
        return _call("torch", "nn.functional.elu", ref, **_optional_kwargs(
            g, alpha=lambda: r.choice([1.0, 0.5, 2.0])))
    if f == "celu":
        return _call("torch", "nn.functional.celu", ref, r.choice([1.0, 0.5, 2.0]))
    if f == "softplus":
        return _call("torch", "nn.functional.softplus", ref, **_optional_kwargs(
            g, beta=lambda: r.choice([1.0, 2.0, 0.5]), threshold=lambda: r.choice([20.0, 1.0])))
    if f == "hardtanh":
        return _call("torch", "nn.functional.hardtanh", ref, r.choice([-1.0, -2.0, 0.0]),
                     r.choice([1.0, 2.0, 0.5]))
    if f == "clamp":
        lo = g.scalar(t.dtype) if r.random() < 0.7 else None
        hi = g.scalar(t.dtype) if r.random() < 0.7 or lo is None else None
        return _call("torch", "clamp", ref, **{"min": lo, "max": hi})
    if f == "clamp_min":
        return _call("torch", r.choice(["clamp_min", "clamp_max"]), ref, g.scalar(t.dtype))
    if f == "round":
        return _call("torch", "round", ref, decimals=r.choice([0, 1, 2, -1]))
    if f == "logit":
        return _call("torch", "logit", ref,
                     **_optional_kwargs(g, eps=lambda: r.choice([0.1, 0.25])))
    if f == "pow":
        return _call("torch", "pow", ref, r.choice([2, 3, -1, -2, 0.5, 2.0, -1.0, 0, 1]))
    if f == "float_power_scalar":
        return _call("torch", "pow", r.choice([2, 2.0, -1.5]), ref)
    if f == "nan_to_num":
        return _call("torch", "nan_to_num", ref, **_optional_kwargs(
            g, nan=lambda: r.choice([0.0, -1.0]), posinf=lambda: r.choice([1.0, 100.0]),
            neginf=lambda: r.choice([-1.0, -100.0])))
    if f == "threshold":
        return _call("torch", "nn.functional.threshold", ref, r.choice([0.5, -1.0, 0.0]),
                     r.choice([-2.0, 0.0, 7.0]))
    return None


_BINARY = ["add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow",
           "atan2", "maximum", "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge",
           "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
           "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "hypot", "copysign",
           "xlogy", "logaddexp", "heaviside", "nextafter", "gcd", "lcm", "rsub",
           "special.xlog1py", "logaddexp2", "igamma"]


@family(2.5)
def binary(g):
    ref, t = g.pick()
    r = g.rng
    name = r.choice(_BINARY)
    other = g.other(t)
    kwargs = {}
    if name in ("add", "sub", "rsub") and r.random() < 0.4:
        kwargs["alpha"] = g.scalar(t.dtype)
    if name == "div" and r.random() < 0.6:
        kwargs["rounding_mode"] = r.choice(["floor", "trunc", None])
    if r.random() < 0.15 and not isinstance(other, Ref):
        return _call("torch", name, other, ref, **kwargs) if name in (
            "add", "mul", "maximum", "eq", "pow", "sub", "remainder") else None
    return _call("torch", name, ref, other, **kwargs)


@family(1.0)
def ternary(g):
    ref, t = g.pick()
    r = g.rng
    name = r.choice(["where", "lerp", "addcmul", "addcdiv", "clamp_tensor"])
    if name == "where":
        cond = g.other(t, allow_scalar=False, dtypes=(torch.bool,))
        return _call("torch", "where", cond, ref, g.other(t))
    if name == "lerp":
        w = g.scalar(torch.float32) if r.random() < 0.5 else g.other(t, allow_scalar=False)
        return _call("torch", "lerp", ref, g.other(t, allow_scalar=False), w)
    if name in ("addcmul", "addcdiv"):
        return _call("torch", name, ref, g.other(t, allow_scalar=False),
                     g.other(t, allow_scalar=False),
                     **_optional_kwargs(g, value=lambda: g.scalar()))
    return _call("torch", "clamp", ref, g.other(t, allow_scalar=False),
                 g.other(t, allow_scalar=False))


_REDUCE = ["sum", "mean", "prod", "amax", "amin", "nansum", "logsumexp", "std", "var", "all",
           "any", "count_nonzero", "norm", "argmax", "argmin", "max", "min", "median", "std_mean",
           "var_mean", "aminmax", "linalg.vector_norm", "nanmean"]


@family(2.5)
def reduce(g):
    ref, t = g.pick()
    r = g.rng
    name = r.choice(_REDUCE)
    if name in ("argmax", "argmin", "median", "max", "min", "prod", "nanmedian"):
        dim = g.dim(t) if r.random() < 0.75 else None
    else:
        dim = g.dims(t)
    kwargs = {}
    if dim is not None:
        kwargs["dim"] = dim
        if name != "count_nonzero" and r.random() < 0.5:
            kwargs["keepdim"] = g.bool()
    if name in ("sum", "prod", "mean", "nansum") and r.random() < 0.25:
        kwargs["dtype"] = r.choice([torch.float32, torch.int64])
    if name in ("std", "var", "std_mean", "var_mean") and r.random() < 0.6:
        kwargs["correction"] = r.choice([0, 1, 2])
    if name == "norm" and r.random() < 0.6:
        kwargs["p"] = r.choice([1, 2, 3, 1.5, float("inf"), "fro"])
    if name == "linalg.vector_norm" and r.random() < 0.6:
        kwargs["ord"] = r.choice([1, 2, 0.5, float("inf"), -1])
    if name == "logsumexp" and dim is None:
        kwargs["dim"] = g.dim(t)
    if name in ("max", "min", "median", "argmax", "argmin") and dim is None:
        kwargs.pop("keepdim", None)
    return _call("torch", name, ref, **kwargs)


@family(1.5)
def scan(g):
    ref, t = g.pick()
    r = g.rng
    name = r.choice(["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax",
                     "log_softmax", "normalize", "layer_norm", "diff", "glu"])
    d = g.dim(t)
    if name in ("cumsum", "cumprod", "softmax", "log_softmax"):
        kwargs = _optional_kwargs(g, dtype=lambda: r.choice([torch.float32, torch.int64]))
        if name in ("softmax", "log_softmax"):
            return _call("torch", name, ref, d, **kwargs)
        return _call("torch", name, ref, d, **kwargs)
    if name in ("cummax", "cummin", "logcumsumexp"):
        return _call("torch", name, ref, d)
    if name == "normalize":
        return _call("torch", "nn.functional.normalize", ref, **_optional_kwargs(
            g, p=lambda: r.choice([1.0, 2.0, 3]), dim=d))
    if name == "layer_norm" and t.dim():
        k = r.randint(1, t.dim())
        return _call("torch", "nn.functional.layer_norm", ref, tuple(t.shape[-k:]),
                     **_optional_kwargs(g, eps=lambda: r.choice([1e-5, 0.1])))
    if name == "diff" and t.dim():
        return _call("torch", "diff", ref, **_optional_kwargs(g, n=lambda: r.randint(1, 2), dim=d))
    if name == "glu" and t.dim():
        return _call("torch", "nn.functional.glu", ref, d)
    return None


@family(2.5)
def copies(g):
    ref, t = g.pick()
    r = g.rng
    name = r.choice(["flip", "roll", "tril", "triu", "repeat", "tile", "cat", "stack", "clone",
                     "contiguous", "to", "full_like", "zeros_like", "ones_like", "gather",
                     "index_select", "take_along_dim", "sort", "argsort", "topk", "kthvalue",
                     "pad", "repeat_interleave", "rot90", "masked_fill", "index_fill", "scatter",
                     "scatter_add", "index_add", "index_copy", "narrow_copy", "type_as"])
    if name == "flip":
        dims = g.dims(t, allow_none=False)
        return _call("torch", "flip", ref, dims if isinstance(dims, tuple) else (dims,))
    if name == "roll":
        if r.random() < 0.3:
            return _call("torch", "roll", ref, r.randint(-5, 5))
        dims = g.dims(t, allow_none=False)
        dims = dims if isinstance(dims, tuple) else (dims,)
        return _call("torch", "roll", ref, tuple(r.randint(-4, 4) for _ in dims), dims)
    if name in ("tril", "triu"):
        return _call("torch", name, ref, r.randint(-2, 2))
    if name in ("repeat", "tile"):
        sizes = [r.randint(1, 2) for _ in range(t.dim() + r.randint(0, 1))] or [2]
        return _call("method", name, ref, tuple(sizes))
    if name in ("cat", "stack"):
        same = g.pick(lambda v: v.shape == t.shape and v.dtype == t.dtype)
        other = same[0] if same is not None and r.random() < 0.5 else \
            g.fresh(tuple(t.shape), t.dtype)
        d = g.dim(t, extra=1 if name == "stack" else 0)
        items = [ref, other] if r.random() < 0.8 else [ref, other, ref]
        return _call("torch", name, items if r.random() < 0.5 else tuple(items), d)
    if name in ("clone", "contiguous"):
        return _call("method", name, ref)
    if name == "to":
        return _call("method", "to", ref, r.choice(DTYPES))
    if name in ("zeros_like", "ones_like"):
        return _call("torch", name, ref, **_optional_kwargs(g, dtype=lambda: r.choice(DTYPES)))
    if name == "full_like":
        return _call("torch", "full_like", ref, g.scalar(t.dtype), **_optional_kwargs(
            g, dtype=lambda: r.choice(DTYPES)))
    if name in ("gather", "take_along_dim") and t.dim():
        d = g.dim(t)
        shape = [r.randint(1, s) if s else 0 for s in t.shape]
        idx = g.indices(shape, t.shape[d], unique_dim=None)
        if name == "gather":
            return _call("torch", "gather", ref, d, _nonneg(g, idx, t.shape[d]))
        return _call("torch", "take_along_dim", ref, _nonneg(g, idx, t.shape[d]), dim=d)
    if name == "index_select" and t.dim():
        d = g.dim(t)
        idx = g.indices((r.randint(0, 4),), t.shape[d])
        return _call("torch", "index_select", ref, d, _nonneg(g, idx, t.shape[d]))
    if name in ("sort", "argsort"):
        kwargs = _optional_kwargs(g, dim=lambda: g.dim(t), descending=g.bool)
        if name == "sort" and r.random() < 0.3:
            kwargs["stable"] = True
        return _call("torch", name, ref, **kwargs)
    if name == "topk" and t.dim():
        d = g.dim(t)
        return _call("torch", "topk", ref, r.randint(0, t.shape[d]), d, **_optional_kwargs(
            g, largest=g.bool, sorted=True))
    if name == "kthvalue" and t.dim():
        d = g.dim(t)
        return _call("torch", "kthvalue", ref, r.randint(1, max(t.shape[d], 1)), d,
                     **_optional_kwargs(g, keepdim=g.bool))
    if name == "pad" and t.dim():
        pad = tuple(r.randint(-1, 2) for _ in range(2 * r.randint(1, min(t.dim(), 3))))
        return _call("torch", "nn.functional.pad", ref, pad, **_optional_kwargs(
            g, value=lambda: g.scalar(torch.float32)))
    if name == "repeat_interleave":
        return _call("torch", "repeat_interleave", ref, r.randint(1, 3), **_optional_kwargs(
            g, dim=lambda: g.dim(t)))
    if name == "rot90" and t.dim() >= 2:
        a, b = r.sample(range(t.dim()), 2)
        return _call("torch", "rot90", ref, r.randint(-2, 3), (a, b - t.dim()))
    if name == "masked_fill":
        mask = g.other(t, allow_scalar=False, dtypes=(torch.bool,))
        return _call("torch", "masked_fill", ref, mask, g.scalar(t.dtype))
    if name in ("index_fill", "index_add", "index_copy") and t.dim():
        return _index_op(g, ref, t, name)
    if name in ("scatter", "scatter_add") and t.dim():
        return _scatter(g, ref, t, name)
    if name == "narrow_copy" and t.dim():
        d = g.dim(t)
        start = r.randint(0, t.shape[d])
        return _call("torch", "narrow_copy", ref, d, start, r.randint(0, t.shape[d] - start))
    if name == "type_as":
        other = g.pick()
        return _call("method", "type_as", ref, other[0]) if other else None
    return None


def _nonneg(g, idx_ref, size):
    """Index tensors for gather-like ops must be in [0, size): rewrite the fresh one."""
    step = g.pending[-1]
    g.pending[-1] = step.replace(data=step.data.remainder(max(size, 1)))
    return idx_ref


def _index_op(g, ref, t, name):
    r = g.rng
    d = g.dim(t)
    size = t.shape[d]
    n = r.randint(0, min(size, 3)) if name == "index_copy" else r.randint(0, 4)
    if name == "index_copy" or name == "index_fill":
        idx = g.fresh_data(unique_indices(r, (n,), size, 0)) if n <= size else None
    else:
        idx = g.indices((n,), size)
        _nonneg(g, idx, size)
    if idx is None:
        return None
    if name == "index_fill":
        return _call("torch", "index_fill", ref, d, idx, g.scalar(t.dtype))
    src_shape = list(t.shape)
    src_shape[d] = n
    src = g.fresh(tuple(src_shape), t.dtype)
    kwargs = _optional_kwargs(g, alpha=lambda: g.scalar(t.dtype)) if name == "index_add" else {}
    return _call("torch", name, ref, d, idx, src, **kwargs)


def _scatter(g, ref, t, name):
    r = g.rng
    d = g.dim(t)
    shape = [r.randint(0, s) for s in t.shape]
    shape[d] = min(shape[d], t.shape[d])
    if name == "scatter":  # distinct targets along d: no write order to depend on
        idx = g.fresh_data(unique_indices(r, shape, t.shape[d], d % t.dim()))
    else:
        idx = g.indices(shape, t.shape[d])
        _nonneg(g, idx, t.shape[d])
    if name == "scatter" and r.random() < 0.4:
        return _call("torch", "scatter", ref, d, idx, g.scalar(t.dtype))
    src = g.fresh(tuple(shape), t.dtype)
    kwargs = {}
    if name == "scatter" and r.random() < 0.3:
        kwargs["reduce"] = r.choice(["add", "multiply"])
    return _call("torch", name, ref, d, idx, src, **kwargs)


_INPLACE_UNARY = ["neg_", "abs_", "floor_", "exp_", "sqrt_", "relu_", "zero_", "sigmoid_",
                  "tanh_", "round_", "clamp_", "fill_", "tril_", "triu_", "unsqueeze_",
                  "squeeze_", "transpose_", "t_", "sign_", "logical_not_", "bitwise_not_",
                  "trunc_", "reciprocal_", "square_", "cumsum_", "nan_to_num_"]
_INPLACE_BINARY = ["add_", "sub_", "mul_", "div_", "copy_", "masked_fill_", "lerp_", "addcmul_",
                   "maximum", "clamp_min_", "remainder_", "pow_", "bitwise_and_", "logical_or_",
                   "fmod_", "floor_divide_", "atan2_", "hypot_", "copysign_", "eq_", "lt_"]


@family(3.0)
def inplace(g):
    """A write into a value, through views where there are some."""
    got = g.pick(prefer_views=True)
    ref, t = got
    r = g.rng
    if r.random() < 0.4:
        name = r.choice(_INPLACE_UNARY)
        if name == "clamp_":
            return _call("method", name, ref, g.scalar(t.dtype), g.scalar(t.dtype))
        if name == "fill_":
            return _call("method", name, ref, g.scalar(t.dtype))
        if name in ("tril_", "triu_"):
            return _call("method", name, ref, r.randint(-1, 1))
        if name in ("unsqueeze_", "cumsum_"):
            return _call("method", name, ref, g.dim(t, extra=int(name == "unsqueeze_")))
        if name == "squeeze_":
            return _call("method", name, ref, *([] if r.random() < 0.4 else [g.dim(t)]))
        if name == "transpose_":
            return _call("method", name, ref, g.dim(t), g.dim(t))
        return _call("method", name, ref)
    name = r.choice(_INPLACE_BINARY)
    if name == "maximum":  # an out= write
        return _out_write(g, ref, t)
    if name == "masked_fill_":
        return _call("method", name, ref, g.other(t, allow_scalar=False, same_shape=True,
                                                  dtypes=(torch.bool,)), g.scalar(t.dtype))
    if name == "lerp_":
        return _call("method", name, ref, g.other(t, allow_scalar=False, same_shape=True),
                     g.scalar(torch.float32))
    if name == "addcmul_":
        return _call("method", name, ref, g.other(t, allow_scalar=False, same_shape=True),
                     g.other(t, allow_scalar=False, same_shape=True),
                     **_optional_kwargs(g, value=lambda: g.scalar(t.dtype)))
    kwargs = {}
    if name in ("add_", "sub_") and r.random() < 0.4:
        kwargs["alpha"] = g.scalar(t.dtype)
    if name == "div_" and r.random() < 0.5:
        kwargs["rounding_mode"] = r.choice(["floor", "trunc"])
    return _call("method", name, ref, g.other(t, same_shape=True), **kwargs)


def _out_write(g, ref, t):
    """torch.<op>(a, b, out=t): the result written into an existing value (a view, often)."""
    r = g.rng
    name = r.choice(["add", "mul", "sub", "maximum", "neg", "clamp", "cumsum", "sum"])
    a = g.pick(lambda v: v.shape == t.shape)
    a = a[0] if a is not None and r.random() < 0.6 else g.fresh(tuple(t.shape), t.dtype)
    if r.random() < 0.3:
        a = ref  # the output is an input too
    if name == "neg":
        return _call("torch", "neg", a, out=ref)
    if name == "clamp":
        return _call("torch", "clamp", a, g.scalar(t.dtype), out=ref)
    if name == "cumsum":
        return _call("torch", "cumsum", a, g.dim(t), out=ref)
    if name == "sum":
        src = g.fresh((r.randint(1, 3),) + tuple(t.shape), t.dtype)
        return _call("torch", "sum", src, 0, out=ref)
    return _call("torch", name, a, g.other(t, same_shape=True), out=ref)


@family(2.0)
def setitem(g):
    """``t[index] = value``: basic indices, boolean masks and integer index tensors."""
    ref, t = g.pick(prefer_views=True)
    r = g.rng
    kind = r.random()
    if kind < 0.6 or not t.dim():
        index = _basic_index(g, t)
    elif kind < 0.8:
        index = g.fresh(tuple(t.shape[:r.randint(1, t.dim())]), torch.bool)
    else:
        d0 = t.shape[0]
        n = r.randint(0, d0)
        index = g.fresh_data(unique_indices(r, (n,), d0, 0) - (d0 if r.random() < 0.3 else 0))
        if r.random() < 0.3 and t.dim() > 1:
            index = (index, slice(None, None, None) if r.random() < 0.5 else g.index_in(t.shape[1]))
    if r.random() < 0.5:
        value = g.scalar(t.dtype)
    else:
        # A value of the indexed shape (or broadcasting to it), computed from eager.
        try:
            target = t[_concrete_index(g, index)]
        except Exception:  # noqa: BLE001 - not a valid index: let eager reject the step
            return None
        value = g.other(target, allow_scalar=False, same_shape=True)
    return Step("setitem", "setitem", (ref, index, value), n_out=None)


def _concrete_index(g, index):
    """An index with Refs to pending inputs replaced by their data."""
    from differential import _resolve

    pending = {n_values(g.program) + i: s.data for i, s in enumerate(g.pending)}
    values = list(g.values) + [pending[k] for k in sorted(pending)]
    return _resolve(index, values, "cpu")


@family(1.0)
def factories(g):
    r = g.rng
    name = r.choice(["arange", "full", "zeros", "ones", "eye", "linspace", "tril_indices",
                     "scalar_tensor"])
    if name == "arange":
        args = r.choice([(r.randint(-3, 6),), (r.randint(-4, 2), r.randint(0, 6)),
                         (r.choice([-2, 0, 1, -1.5, 0.5]), r.choice([3, 4.5, 6, -4]),
                          r.choice([1, 2, -1, 0.5, -0.5, 1.5]))])
        return _call("torch", "arange", *args, device=DEVICE, **_optional_kwargs(
            g, dtype=lambda: r.choice([torch.float32, torch.int64])))
    if name == "full":
        return _call("torch", "full", g.shape(), g.scalar(), device=DEVICE)
    if name in ("zeros", "ones"):
        return _call("torch", name, g.shape(), device=DEVICE, dtype=r.choice(DTYPES))
    if name == "eye":
        return _call("torch", "eye", r.randint(0, 4), *([r.randint(1, 4)] if g.bool() else []),
                     device=DEVICE)
    if name == "linspace":
        return _call("torch", "linspace", r.choice([-1.0, 0.0, 2]), r.choice([1.0, 3, -2.5]),
                     r.randint(1, 6), device=DEVICE)
    if name == "tril_indices":
        return _call("torch", r.choice(["tril_indices", "triu_indices"]), r.randint(1, 4),
                     r.randint(1, 4), r.randint(-2, 2), device=DEVICE)
    return _call("torch", "scalar_tensor", g.scalar(torch.float32), device=DEVICE)


@family(1.5)
def linalg(g):
    got = g.pick(lambda v: _is_float(v) and v.dim() >= 1)
    r = g.rng
    if got is None:
        got = (g.fresh(g.shape(r.randint(1, 3)), torch.float32), None)
        x_shape = g.pending[-1].data.shape
    else:
        x_shape = got[1].shape
    ref = got[0]
    name = r.choice(["matmul", "mm", "bmm", "mv", "dot", "outer", "addmm", "linear", "einsum",
                     "baddbmm", "tensordot"])
    k = x_shape[-1]
    if name == "matmul":
        shape = r.choice([(k,), (k, r.randint(1, 3)), (r.randint(1, 2), k, r.randint(1, 3))])
        return _call("torch", "matmul", ref, g.fresh(shape, torch.float32))
    if name == "mm" and len(x_shape) == 2:
        return _call("torch", "mm", ref, g.fresh((k, r.randint(1, 3)), torch.float32))
    if name == "bmm" and len(x_shape) == 3:
        return _call("torch", "bmm", ref, g.fresh((x_shape[0], k, r.randint(1, 3)), torch.float32))
    if name == "mv" and len(x_shape) == 2:
        return _call("torch", "mv", ref, g.fresh((k,), torch.float32))
    if name == "dot" and len(x_shape) == 1:
        return _call("torch", "dot", ref, g.fresh((k,), torch.float32))
    if name == "outer" and len(x_shape) == 1:
        return _call("torch", "outer", ref, g.fresh((r.randint(1, 3),), torch.float32))
    if name == "addmm" and len(x_shape) == 2:
        n = r.randint(1, 3)
        return _call("torch", "addmm", g.fresh((x_shape[0], n), torch.float32), ref,
                     g.fresh((k, n), torch.float32), **_optional_kwargs(
                         g, beta=lambda: r.choice([0.5, 2.0, 0]),
                         alpha=lambda: r.choice([-1.0, 2])))
    if name == "linear":
        n = r.randint(1, 3)
        bias = g.fresh((n,), torch.float32) if g.bool() else None
        return _call("torch", "nn.functional.linear", ref, g.fresh((n, k), torch.float32), bias)
    if name == "einsum" and len(x_shape) == 2:
        eq, shape = r.choice([("ij,jk->ik", (k, 2)), ("ij,kj->ik", (3, k)), ("ij,j->i", (k,)),
                              ("ij,ij->j", tuple(x_shape)), ("ij,jk->ki", (k, 2))])
        return _call("torch", "einsum", eq, ref, g.fresh(shape, torch.float32))
    if name == "baddbmm" and len(x_shape) == 3:
        n = r.randint(1, 3)
        return _call("torch", "baddbmm", g.fresh((x_shape[0], x_shape[1], n), torch.float32), ref,
                     g.fresh((x_shape[0], k, n), torch.float32), **_optional_kwargs(
                         g, beta=lambda: r.choice([0.5, 2.0]), alpha=lambda: r.choice([-1.0, 2])))
    if name == "tensordot" and len(x_shape) >= 2:
        return _call("torch", "tensordot", ref, g.fresh(tuple(x_shape[-2:]) + (2,), torch.float32),
                     dims=2)
    return None


@family(0.4)
def sync(g):
    return Step("sync", n_out=0)


@family(1.0)
def backward(g):
    """``t.sum().backward()`` (or of another reduction) from a value that requires grad, then
    reading a leaf's ``.grad``."""
    r = g.rng
    with_grad = g.pick(lambda v: v.is_leaf and v.grad is not None, recent=False)
    if with_grad is not None and r.random() < 0.5:
        return Step("attr", "grad", (with_grad[0],), n_out=None)
    got = g.pick(lambda v: v.requires_grad)
    if got is None:
        return None
    ref, t = got
    if t.dim():
        reduce = r.choice(["sum", "mean", "amax", "logsumexp"])
        args = (ref, -1) if reduce == "logsumexp" else (ref,)
        g.pending.append(Step("torch", reduce, args, n_out=1))
        ref = Ref(n_values(g.program) + len(g.pending) - 1)
        if reduce == "logsumexp" and t.dim() > 1:
            g.pending.append(Step("torch", "sum", (ref,), n_out=1))
            ref = Ref(ref.index + 1)
    return Step("method", "backward", (ref,), n_out=None)


_FOREACH_UNARY = ["neg", "abs", "exp", "sqrt", "sign", "sigmoid", "tanh", "log", "reciprocal",
                  "rsqrt", "sin", "cos", "expm1", "log1p", "zero"]
_FOREACH_BINARY = ["add", "mul", "sub", "div", "maximum", "minimum", "pow", "clamp_min",
                   "clamp_max", "copy"]


@family(1.0)
def foreach(g):
    """``torch._foreach_*`` over a list of values (what torch.optim's foreach path records)."""
    r = g.rng
    items = [g.pick(_is_float) for _ in range(r.randint(1, 3))]
    items = [i for i in items if i is not None]
    if not items:
        return None
    refs = [i[0] for i in items]
    inplace = r.random() < 0.5
    kind = r.random()
    if kind < 0.3:
        name = r.choice(_FOREACH_UNARY)
        return _call("torch", f"_foreach_{name}{'_' if inplace or name == 'zero' else ''}", refs)
    if kind < 0.4:
        return _call("torch", "_foreach_norm", refs, *([r.choice([1, 2, float("inf")])]
                                                     if r.random() < 0.5 else []))
    def same(i):  # a tensor like items[i]: itself, another value, or fresh
        v = items[i][1]
        other = g.pick(lambda w: w.shape == v.shape and w.dtype == v.dtype)
        return other[0] if other is not None and r.random() < 0.5 else g.fresh(tuple(v.shape),
                                                                                  v.dtype)
    if kind < 0.55:
        name = r.choice(["lerp", "addcmul", "addcdiv"])
        others = [[same(i) for i in range(len(items))] for _ in range(1 if name == "lerp" else 2)]
        last = g.scalar(torch.float32)
        return _call("torch", f"_foreach_{name}{'_' if inplace else ''}", refs, *others, last)
    name = r.choice(_FOREACH_BINARY)
    form = r.random()
    if name == "copy":
        other = [same(i) for i in range(len(items))]
        return _call("torch", "_foreach_copy_", refs, other)
    if form < 0.4:
        other = g.scalar(torch.float32)
    elif form < 0.6:
        other = [g.scalar(torch.float32) for _ in items]
    else:
        other = [same(i) for i in range(len(items))]
    kwargs = {"alpha": g.scalar(torch.float32)} if name in ("add", "sub") and not isinstance(
        other, (float, int)) and isinstance(other, list) and isinstance(other[0], Ref) and \
        r.random() < 0.4 else {}
    return _call("torch", f"_foreach_{name}{'_' if inplace else ''}", refs, other, **kwargs)


@family(2.0)
def opinfo(g):
    """A sample input of an OpInfo, its input replaced by a value of the program when one has
    the sample input's shape and dtype."""
    ops = opinfo_ops()
    r = g.rng
    name, dtype = r.choice(ops)
    samples = _samples(name, dtype)
    if not samples:
        return None
    sample = r.choice(samples)
    inplace = _op(name).inplace_variant is not None and r.random() < 0.3
    variant = "inplace" if inplace else "function"

    def convert(x, first=False):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if first:
                same = g.pick(lambda v: v.shape == x.shape and v.dtype == x.dtype,
                              prefer_views=variant == "inplace")
                if same is not None and r.random() < 0.7:
                    return same[0]
            return g.fresh_data(x.clone())
        if isinstance(x, torch.Size):
            return tuple(x)
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        if isinstance(x, torch.device) or (isinstance(x, str) and x == "cpu"):
            return DEVICE
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype, slice)) or \
                x is Ellipsis or isinstance(x, torch.memory_format):
            return x
        raise InvalidProgram(f"sample argument {type(x).__name__}")

    try:
        args = (convert(sample.input, first=True),) + tuple(convert(a) for a in sample.args)
        kwargs = {k: convert(v) for k, v in sample.kwargs.items()}
    except InvalidProgram:
        return None
    return _opinfo_step(name, variant, args, kwargs)


def _opinfo_step(name, variant, args, kwargs):
    """The most readable step for an OpInfo call: ``torch.name(...)``, ``t.name_(...)``, or the
    OpInfo's own callable."""
    op = _op(name)
    fn = op.op if variant == "function" else op.inplace_variant
    if variant == "function":
        try:
            resolved = _torch_path(op.name)
        except AttributeError:
            resolved = None
        if resolved is fn:
            return Step("torch", op.name, args, tuple(kwargs.items()), n_out=None)
    method = getattr(fn, "__name__", None)
    if variant == "inplace" and method and getattr(torch.Tensor, method, None) is fn:
        return Step("method", method, args, tuple(kwargs.items()), n_out=None)
    return Step("opinfo", f"{name}|{variant}", args, tuple(kwargs.items()), n_out=None)


def _torch_path(name):
    obj = torch
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# OpInfos left out: random or uninitialised results, ops with data-dependent output shapes or
# without a lowering (they run on CPU: no graph to test), dtypes we do not generate.
_OPINFO_EXCLUDE_PREFIX = ("fft.", "linalg.", "sparse.", "to_sparse", "signal.", "special.",
                          "masked.", "_", "nn.functional.dropout", "nn.functional.alpha_dropout",
                          "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
                          "nn.functional.fractional", "nn.functional.ctc_loss", "empty",
                          "new_empty", "rand", "normal", "bernoulli", "multinomial", "uniform",
                          "cauchy", "exponential", "geometric", "log_normal", "histogram",
                          "unique", "nonzero", "masked_select", "bincount", "svd", "pca",
                          "lu", "cholesky", "qr", "geqrf", "ormqr", "inverse", "det", "logdet",
                          "slogdet", "pinverse", "matrix_exp", "eig", "triangular_solve",
                          "lstsq", "symeig", "torch.", "combinations", "nanquantile",
                          "quantile", "stft", "istft", "corrcoef", "cov",
                          "nn.functional.embedding_bag",
                          "jiterator", "item", "tolist", "argwhere", "count_nonzero", "resize",
                          "nn.functional.multi_head", "nn.functional.scaled_dot", "randint",
                          "cdouble", "cfloat", "chalf", "double", "half", "bfloat16", "complex",
                          "view_as_complex", "polar", "isin", "searchsorted", "bucketize",
                          "nn.functional.grid_sample", "nn.functional.unfold", "take",
                          "put", "index_reduce", "scatter_reduce", "mvlgamma", "polygamma",
                          "special",
                          "nn.functional.max_unpool", "nn.functional.pdist", "cdist",
                          "nn.functional.pairwise", "nn.functional.cosine_similarity",
                          "native_batch_norm", "addbmm", "nn.functional.batch_norm",
                          "nn.functional.instance_norm", "argsort", "sort", "topk", "msort",
                          "kthvalue", "mode", "median", "nanmedian", "aminmax", "max", "min",
                          "argmax", "argmin", "cummax", "cummin", "allclose", "equal",
                          "nn.functional.gaussian_nll", "nn.functional.nll_loss",
                          "nn.functional.multilabel", "nn.functional.multi_margin",
                          "nn.functional.hinge", "constant_pad", "as_strided", "new_",
                          "tensor_split",  # its index tensor must be on the host
                          "nn.functional.softmin", "index_put", "narrow_copy")


@functools.cache
def opinfo_ops():
    """(full name, dtype) pairs of the OpInfos the ``opinfo`` family samples."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = []
    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if name.startswith(_OPINFO_EXCLUDE_PREFIX) or op.name.split(".")[0] in TIE_SENSITIVE:
            continue
        for dtype in DTYPES:
            if dtype in op.supported_dtypes("cpu"):
                out.append((name, dtype))
    return out


@functools.cache
def _ops_by_name():
    from torch.testing._internal.common_methods_invocations import op_db

    return {op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""): op
            for op in op_db}


def _op(name):
    return _ops_by_name()[name]


def opinfo_function(name: str):
    """The callable of ``"opinfo name|function"`` or ``"opinfo name|inplace"``."""
    full, variant = name.split("|")
    op = _op(full)
    return op.op if variant == "function" else op.inplace_variant


@functools.lru_cache(maxsize=None)
def _samples(name, dtype, limit=6, max_numel=256):
    """The first ``limit`` sample inputs of an OpInfo, small ones only (deterministic: the
    generator is seeded)."""
    from torch.testing._internal.opinfo import core

    op = _op(name)
    # Sample iterators look for a unittest frame on the stack (inspect.stack(), slow); none here.
    saved = core.extract_test_fn
    core.extract_test_fn = lambda: None
    torch.manual_seed(0)
    out = []
    try:
        for i, s in enumerate(op.sample_inputs("cpu", dtype)):
            if i >= limit:
                break
            tensors = [x for x in [s.input, *s.args, *s.kwargs.values()]
                       if isinstance(x, torch.Tensor)]
            if isinstance(s.input, torch.Tensor) and all(x.numel() <= max_numel for x in tensors):
                out.append(s)
    except Exception:  # noqa: BLE001 - a broken sample generator: the op is not sampled
        return ()
    finally:
        core.extract_test_fn = saved
    return tuple(out)


# -- growing a program -----------------------------------------------------------------------------


def generate(rng: random.Random, steps=None, max_tries: int = 60):
    """A random valid program of 1-2 inputs and ``steps`` calls (2-6), or None."""
    g = Gen(rng)
    for _ in range(rng.randint(1, 2)):
        dtype = rng.choice([torch.float32] * 3 + [torch.int64] * 2 + [torch.bool])
        g.fresh(g.shape(), dtype)
        if dtype == torch.float32 and rng.random() < 0.3:
            g.pending[-1] = g.pending[-1].replace(grad=True)
    g.program, g.values = settle(tuple(g.pending))
    g.pending = []
    steps = rng.randint(2, 6) if steps is None else steps
    weights = [w for w, _ in FAMILIES]
    calls = 0
    for _ in range(max_tries):
        if calls >= steps:
            break
        g.pending = []
        fam = rng.choices([f for _, f in FAMILIES], weights)[0]
        try:
            step = fam(g)
        except (InvalidProgram, IndexError, ValueError, RuntimeError):
            step = None
        if step is None:
            continue
        try:
            program, values = settle(g.program + tuple(g.pending) + (step,))
        except InvalidProgram:
            continue
        g.program, g.values = program, values
        calls += 1
    if calls == 0:
        return None
    return g.program
