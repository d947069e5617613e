"""Differential testing: small random programs on xshard against eager CPU PyTorch, in one process.

[Note: differential programs]
A ``Program`` is a straight line of ``Step``s, each producing zero or more values, numbered in the
order they appear (``t0``, ``t1``, ...). A step is one of:

- ``input``: a CPU tensor moved to the device (``torch.tensor(..., device=dev)``), a leaf that
  requires grad when ``grad`` is set (``t.sum().backward()`` is a ``method`` step);
- ``torch``: ``torch.<name>(*args, **kwargs)`` (``name`` may be dotted: ``nn.functional.gelu``);
- ``method``: ``args[0].<name>(*args[1:], **kwargs)``; an in-place method (name ending in ``_``)
  produces no value, as do ``torch`` calls writing ``out=``;
- ``getitem`` / ``setitem``: ``args[0][args[1]]`` / ``args[0][args[1]] = args[2]``;
- ``attr``: ``args[0].<name>`` (``t.grad``);
- ``opinfo``: the function (or in-place variant) of an OpInfo of PyTorch's ``op_db``;
- ``sync``: ``xshard.sync()`` in the middle of a program.

Arguments are Python literals (ints, floats, bools, None, strings, slices, Ellipsis, dtypes),
``Ref``s to earlier values, ``DEVICE`` (the device the program runs on) and tuples/lists of those.

``check(program)`` runs the program eagerly on CPU (an exception there means the program is not
valid: it is discarded, not failed), then on ``xshard.device()``, and compares every value at the
end (so writes through views are seen through every alias). Views are cloned before reading, so a
program's results come out of the one graph its final read computes.

Programs run one after another in one process, so a graph that differs from an earlier one in a
single static argument (``x[-1]`` then ``x[-2]``) meets the executable compiled for the earlier one:
``mutants`` makes such neighbours. A failure is shrunk (``shrink``) to a minimal sequence of
programs and printed (``to_python``) as a runnable Python script.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import textwrap
import warnings

import numpy as np
import torch
import torch.utils._python_dispatch
import torch.utils._pytree

import xshard
from xshard.core import api, compiler

# -- programs --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ref:
    """The ``index``-th value of a program."""

    index: int


class _Device:
    def __repr__(self):
        return "dev"


DEVICE = _Device()


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    kind: str  # input | torch | method | getitem | setitem | opinfo | sync
    name: str = ""
    args: tuple = ()
    kwargs: tuple = ()  # ((name, value), ...)
    n_out: int | None = 1  # values produced; None while generating (set from the eager run)
    data: torch.Tensor | None = None  # input steps: the CPU tensor
    unpack: bool = False  # the call returns a sequence of values (printed ``t3, t4 = ...``)
    grad: bool = False  # input steps: the value requires grad

    def replace(self, **changes) -> "Step":
        return dataclasses.replace(self, **changes)


Program = tuple  # of Step


class InvalidProgram(Exception):
    """The program is not a valid test: eager PyTorch rejects it, or its result is not defined."""


# Ops whose result depends on how ties are broken (ATen and XLA may differ): their first tensor
# argument must hold distinct, non-NaN values.
TIE_SENSITIVE = {
    "argmax", "argmin", "sort", "argsort", "topk", "kthvalue", "median", "nanmedian", "mode",
    "max", "min", "cummax", "cummin", "msort", "aminmax",
}


def n_values(program) -> int:
    return sum(step.n_out or 0 for step in program)


def _resolve(obj, values, device):
    if type(obj) is Ref:
        return values[obj.index]
    if obj is DEVICE:
        return device
    if type(obj) is tuple:
        return tuple(_resolve(v, values, device) for v in obj)
    if type(obj) is list:
        return [_resolve(v, values, device) for v in obj]
    if type(obj) is slice:
        return slice(*(_resolve(v, values, device) for v in (obj.start, obj.stop, obj.step)))
    return obj


def _torch_function(name: str):
    obj = torch
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _opinfo_callable(name: str):
    from differential_ops import opinfo_function

    return opinfo_function(name)


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _check_ties(step, args):
    base = step.name.split(".")[0].split("|")[0]
    if base not in TIE_SENSITIVE:
        return
    if step.kind == "torch" and base in ("max", "min") and not (
            len(args) > 1 or any(k == "dim" for k, _ in step.kwargs)):
        return  # max(x), min(x): a value, no index
    x = _first_tensor(args)
    if x is None or x.device.type != "cpu" or x.numel() <= 1:
        return
    if x.dtype.is_floating_point and bool(torch.isnan(x).any()):
        raise InvalidProgram(f"{step.name} over NaN: tie order undefined")
    if torch.unique(x).numel() != x.numel():
        raise InvalidProgram(f"{step.name} over tied values: order undefined")


def _check_defined(step, args):
    """Raises InvalidProgram where eager's result is not defined or hits a known xshard bug."""
    _check_ties(step, args)
    if step.kind == "method" and step.name == "view" and len(args) > 1 and isinstance(
            args[1], torch.dtype) and args[0].dtype.is_floating_point and bool(
            torch.isnan(args[0]).any()):
        raise InvalidProgram("the bits of NaN are not defined")
    if step.kind == "torch" and step.name == "native_layer_norm" and args[0].dtype in (
            torch.float16, torch.bfloat16):
        raise InvalidProgram("native_layer_norm's saved mean and rstd of 16-bit floats: ATen's "
                             "CPU kernel gives them in the input's dtype, PyTorch's meta kernel "
                             "(which xshard conforms to, as CUDA does) in float32")


def _has_subnormals(v) -> bool:
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.numel() == 0:
        return False
    magnitude = v.detach().abs()
    return bool(((magnitude > 0) & (magnitude < torch.finfo(v.dtype).tiny)).any())


_SOFTMAXES = (torch.ops.aten._softmax, torch.ops.aten._log_softmax, torch.ops.aten.softmax,
              torch.ops.aten.log_softmax)
# Known xshard bugs, at the aten call that hits them (each has a strict xfail test in
# test_differential.py): programs hitting one are not valid, so the fuzzer looks for new ones.
KNOWN_BUGS = [
    ("PyTorch's meta kernel of pow(bool tensor, bool) says int64, its CPU kernel bool",
     lambda func, args: func.overloadpacket in (torch.ops.aten.pow, torch.ops.aten.pow_) and
     len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool and
     type(args[1]) is bool),
    ("(log_)softmax of an empty bool tensor: PyTorch's decomposition subtracts bools",
     lambda func, args: func.overloadpacket in _SOFTMAXES and isinstance(args[0], torch.Tensor)
     and args[0].dtype == torch.bool),
    ("linspace/logspace with tensor bounds: PyTorch's reference mixes a CPU tensor in",
     lambda func, args: func.overloadpacket in (torch.ops.aten.linspace, torch.ops.aten.logspace)
     and any(isinstance(a, torch.Tensor) for a in args)),
]


def _execute(step: Step, values, device):
    if step.kind == "input":
        value = step.data.clone().to(device)
        return value.requires_grad_() if step.grad else value
    if step.kind == "sync":
        xshard.sync()
        return None
    args = _resolve(step.args, values, device)
    kwargs = {k: _resolve(v, values, device) for k, v in step.kwargs}
    if device == "cpu":
        _check_defined(step, args)
    if device == "cpu":
        with _EagerRules():
            return _call(step, args, kwargs)
    return _call(step, args, kwargs)


def _call(step: Step, args, kwargs):
    if step.kind == "torch":
        return _torch_function(step.name)(*args, **kwargs)
    if step.kind == "method":
        return getattr(args[0], step.name)(*args[1:], **kwargs)
    if step.kind == "getitem":
        return args[0][args[1]]
    if step.kind == "attr":
        return getattr(args[0], step.name)
    if step.kind == "setitem":
        args[0][args[1]] = args[2]
        return None
    if step.kind == "opinfo":
        return _opinfo_callable(step.name)(*args, **kwargs)
    raise ValueError(f"unknown step kind {step.kind!r}")


def _produces_nothing(step: Step) -> bool:
    if step.kind in ("setitem", "sync"):
        return True
    if step.kind in ("method", "torch") and step.name.endswith("_"):
        return True
    if step.kind == "method" and step.name == "backward":
        return True
    if step.kind == "opinfo" and step.name.endswith("|inplace"):
        return True
    return any(k == "out" for k, _ in step.kwargs)


def _outputs(step: Step, result) -> list:
    if _produces_nothing(step):
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return list(result)
    raise InvalidProgram(f"{step.name} returned {type(result).__name__}, not tensors")


def _run(program, device):
    """Runs ``program``; returns every value at the end and the steps with ``n_out`` settled."""
    values: list = []
    settled = []
    for step in program:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                result = _execute(step, values, device)
            except InvalidProgram:
                raise
            except Exception as e:  # noqa: BLE001 - eager rejects the program
                if device == "cpu":
                    raise InvalidProgram(f"{type(e).__name__}: {e}") from e
                raise
        outs = _outputs(step, result)
        if step.n_out is not None and len(outs) != step.n_out:
            raise InvalidProgram(f"{step.name} gave {len(outs)} values, not {step.n_out}")
        values.extend(outs)
        unpack = isinstance(result, (tuple, list)) and bool(outs)
        if step.n_out != len(outs) or step.unpack != unpack:
            step = step.replace(n_out=len(outs), unpack=unpack)
        settled.append(step)
    return values, tuple(settled)


def run(program, device) -> list:
    """Runs ``program`` on ``device`` ('cpu' or the xshard device); returns every value at the end.

    Raises ``InvalidProgram`` when run on 'cpu' and eager PyTorch rejects the program, or its
    result is not defined (see ``_EagerRules``).
    """
    return _run(program, device)[0]


def settle(program):
    """``program`` with each step's ``n_out`` set from an eager run; raises InvalidProgram."""
    values, settled = _run(program, "cpu")
    return settled, values


def _unrepresentable(x, targets) -> bool:
    """A float (tensor) holding a value that one of the integer dtypes ``targets`` cannot hold
    once truncated: NaN, infinity, or out of its range (int64's taken as +-2**62)."""
    if isinstance(x, torch.Tensor):
        if not x.dtype.is_floating_point or x.numel() == 0:
            return False
        x = x.detach().double().trunc()
    elif type(x) is float:
        x = torch.tensor(x, dtype=torch.float64).trunc()
    else:
        return False
    for dtype in targets:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -2 ** 62), min(info.max, 2 ** 62)
        if not bool(((x >= low) & (x <= high)).all()):
            return True
    return False


def _is_integral(dtype) -> bool:
    return isinstance(dtype, torch.dtype) and not dtype.is_floating_point and \
        not dtype.is_complex and dtype != torch.bool


# Ops whose result jumps where an input crosses a boundary (0, an integer, another input): float
# noise in the last bits (summation order, XLA's transcendental functions) flips them.
_ZERO_BOUNDARY = {"logical_and", "logical_or", "logical_xor", "logical_not", "sign", "sgn",
                  "heaviside", "signbit"}
_EQUALITY_BOUNDARY = {"eq", "ne", "lt", "le", "gt", "ge", "threshold"}
_INTEGER_BOUNDARY = {"floor", "ceil", "round", "trunc", "frac"}
_CONVERSIONS = {"_to_copy", "to", "copy"}
_QUOTIENT_BOUNDARY = {"floor_divide", "remainder", "fmod", "div"}
_NOISE = 1e-5


def _near(x: torch.Tensor, boundary: torch.Tensor) -> bool:
    """Whether some element of ``x`` is within float noise of ``boundary`` but not on it."""
    gap = (x - boundary).abs()
    scale = torch.maximum(x.abs(), boundary.abs()).clamp(min=1.0)
    return bool(((gap > 0) & (gap < _NOISE * scale)).any())


def _bits_unsettled(x: torch.Tensor) -> bool:
    """Whether float tensor ``x`` holds a NaN, a zero (0 * -0 summed is -0 in XLA's dot, +0 in
    ATen's) or a value other than the generator's exact ones (multiples of 1/4 below 2**20,
    infinities): values whose bits a float tolerance does not fix."""
    x = x.detach().double()
    finite = x[torch.isfinite(x)] * 4
    return bool(torch.isnan(x).any()) or bool((finite != finite.round()).any()) or bool(
        (finite.abs() >= 2 ** 22).any()) or bool((x == 0).any())  # a computed zero's sign too


def _ambiguous(name: str, args, kwargs) -> bool:
    """Whether an eager call's result hangs on float noise in its inputs (see above)."""
    floats = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()]
    if not floats:
        return False
    x = floats[0].double()
    dtypes = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(a, torch.dtype)]
    if name in _CONVERSIONS or (dtypes and _is_integral(dtypes[0])):
        # To an integer dtype (a conversion, or an op's dtype= such as cumsum's): a rounding; to
        # bool: a test against 0.
        if not dtypes:
            return False
        if dtypes[0] == torch.bool:
            return _near(x, torch.zeros(()))
        # near an integer on either side: 0.99999994 truncates to 0, 1.0 to 1
        return _is_integral(dtypes[0]) and _near(x, x.round())
    if name in _ZERO_BOUNDARY:
        return any(_near(f.double(), torch.zeros(())) for f in floats)
    if name in _INTEGER_BOUNDARY:
        return _near(x, x.round()) or (name == "round" and _near(x - x.floor(), torch.tensor(.5)))
    numbers = [a for a in args[1:] if isinstance(a, (int, float, torch.Tensor)) and
               not isinstance(a, bool)]
    if name in _EQUALITY_BOUNDARY and numbers:
        other = numbers[0]
        other = other.double() if isinstance(other, torch.Tensor) else torch.tensor(float(other))
        try:
            return _near(x, other) if args[0] is floats[0] else _near(other, x)
        except RuntimeError:  # shapes that do not broadcast: eager raises on its own
            return False
    if name in _QUOTIENT_BOUNDARY and numbers and (name != "div" or kwargs.get("rounding_mode")):
        # A remainder keeps a large computed value's noise whole: a few units in the last place
        # of exp(7.75) = 2321.6 are beyond the tolerance of its fractional part.
        big = x[x.abs() >= 128]
        if bool((big * 4 != (big * 4).round()).any()):
            return True
        other = numbers[0]
        other = other.double() if isinstance(other, torch.Tensor) else torch.tensor(float(other))
        with torch.no_grad():
            q = x / other
        return _near(q, q.round())
    return False


class _EagerRules(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches every aten call of an eager run; raises InvalidProgram where eager's result is
    not defined (C++ leaves a float to int conversion of NaN, infinity or a value out of the
    target's range undefined: x86 gives INT64_MIN, or wraps -1.0 to 255 in uint8; XLA saturates),
    hangs on float noise (a comparison, a rounding or a logical op of a value within 1e-5 of its
    boundary but not on it: ``_ambiguous``), is a
    quirk of ATen's CPU kernels that no other backend shares (its exact GELU gives NaN at +-inf,
    var_mean's Welford mean over an infinity is NaN or inf depending on its position, its
    float32 ndtr below -3 is off by several percent), reads a subnormal float (XLA flushes
    them to zero), or hits a known xshard bug (``KNOWN_BUGS``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        if _ambiguous(name, args, kwargs):
            raise InvalidProgram(f"{func}: its result hangs on float noise in its inputs")
        for reason, applies in KNOWN_BUGS:
            if applies(func, args):
                raise InvalidProgram(f"known xshard bug: {reason}")
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        schema = func._schema
        written = [a.name for a in schema.arguments if a.alias_info is not None and
                   a.alias_info.is_write]
        bound = dict(zip([a.name for a in schema.arguments], args), **kwargs)
        # Written arguments may hold anything (uninitialized memory a copy_ overwrites).
        read = torch.utils._pytree.tree_leaves([v for k, v in bound.items() if k not in written])
        if any(_has_subnormals(v) for v in read):
            raise InvalidProgram(f"{func} reads a subnormal float: XLA flushes them to zero (as "
                                 f"JAX does; see the README's known limits), ATen keeps them")
        targets = {v for v in flat if _is_integral(v)} | {
            bound[n].dtype for n in written
            if isinstance(bound.get(n), torch.Tensor) and _is_integral(bound[n].dtype)}
        if targets and any(_unrepresentable(v, targets) for v in flat):
            raise InvalidProgram(f"{func}: a float that {sorted(map(str, targets))} cannot "
                                 f"represent, converted")
        if name in ("median", "nanmedian") and len(args) == 1 and args[0].numel() == 0 and \
                not args[0].is_floating_point():
            raise InvalidProgram(f"{func} of no integers: eager converts a NaN to the dtype")
        if name.startswith(("upsample_", "_upsample_")) and args[0].dtype == torch.bfloat16:
            raise InvalidProgram(f"{func} in bfloat16: ATen's kernel rounds its weights and "
                                 f"sums to bfloat16 (xshard computes in float32 and rounds once, "
                                 f"nearer the exact value; they differ where terms cancel)")
        if name in ("convolution", "_convolution") and args[0].dtype == torch.float16 and \
                args[6]:
            raise InvalidProgram(f"{func}, transposed, in float16: ATen's CPU kernel sums in "
                                 f"float16 (a third of the values off the exact rounding; "
                                 f"xshard sums in float32 and rounds once)")
        if name == "repeat" and any(r < 0 for r in args[1]):
            raise InvalidProgram("repeat with a negative count: eager's check depends on the "
                                 "shape (PyTorch's meta kernel refuses it always)")
        if name == "index_add" and _is_integral(args[0].dtype) and \
                type(kwargs.get("alpha", args[4] if len(args) > 4 else 1)) is float:
            raise InvalidProgram("index_add of integers with a float alpha: eager truncates it, "
                                 "PyTorch's reference (xshard's meta kernel) refuses it")
        if name == "roll" and args[0].numel() == 0:
            raise InvalidProgram("roll of an empty tensor: eager checks no dims (xshard's meta "
                                 "kernel does)")
        if name in ("grid_sampler_2d", "grid_sampler_3d") and len(args) > 3 and not (
                args[2] in (0, 1, 2) and args[3] in (0, 1, 2)):
            raise InvalidProgram(f"{func}: no such interpolation or padding mode (eager reads "
                                 f"uninitialised memory)")
        if func is torch.ops.aten.view.dtype and args[0].is_floating_point() and \
                _bits_unsettled(args[0]):
            raise InvalidProgram("a float viewed as integers compares its bits exactly, and a "
                                 "computed float's last place (or a NaN's payload) may differ")
        if name == "topk" and len(args) > 1 and args[1] > 1 and (
                kwargs.get("sorted") is False or (len(args) > 4 and args[4] is False)):
            raise InvalidProgram("topk(sorted=False) returns its k values in any order")
        if name == "special_ndtr" and isinstance(args[0], torch.Tensor) and bool(
                (args[0] < -3).any()):
            raise InvalidProgram("ATen's float32 ndtr loses the lower tail (1 + erf cancels)")
        if name in ("var_mean", "std_mean") and isinstance(args[0], torch.Tensor) and bool(
                torch.isinf(args[0]).any()):
            raise InvalidProgram("ATen's Welford mean is NaN or inf by where the infinity is")
        if func.overloadpacket is torch.ops.aten.gelu and kwargs.get(
                "approximate", "none") == "none" and isinstance(args[0], torch.Tensor) and \
                bool(torch.isinf(args[0]).any()):
            raise InvalidProgram("ATen's CPU GELU gives NaN at infinity")
        return func(*args, **kwargs)


# -- checking --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """How xshard's run of a program differs from eager's (``kind`` 'ok' when it does not)."""

    kind: str  # ok | mismatch | error | limitation
    detail: str = ""
    value: int | None = None  # the first value that differs

    @property
    def failed(self) -> bool:
        return self.kind in ("mismatch", "error")

    def same_failure(self, other: "Outcome") -> bool:
        if self.kind != other.kind:
            return False
        if self.kind == "error":
            return self.detail.split(":")[0] == other.detail.split(":")[0]
        return True


FLOAT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# bfloat16 keeps 8 bits: eager and XLA may round an intermediate differently (XLA keeps some fused
# intermediates in float32), a few units in the last place.
BFLOAT16_TOLERANCE = {"rtol": 3e-2, "atol": 1e-2}

# Errors xshard raises on purpose, naming the limitation and the fix: not failures (counted).
KNOWN_LIMITATIONS = (
    # A write through a view whose elements alias one another (a broadcast expand, overlapping
    # unfold windows): which alias a write changed is not in the view's value.
    r"^NotImplementedError: xshard cannot write through a view made by .* overlap",
)


def _compare(got: torch.Tensor, want: torch.Tensor):
    got, want = got.detach(), want.detach()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
    tol = (BFLOAT16_TOLERANCE if want.dtype == torch.bfloat16 else FLOAT_TOLERANCE) \
        if want.dtype.is_floating_point else {}
    try:
        torch.testing.assert_close(got, want, equal_nan=True, check_stride=False, **tol)
    except AssertionError:
        return f"values\n  xshard: {_short(got)}\n  eager:  {_short(want)}"
    return None


def _short(t: torch.Tensor) -> str:
    text = " ".join(str(t.tolist()).split())
    return text if len(text) < 300 else text[:300] + "..."


def read_back(values) -> list:
    """The device ``values`` as CPU tensors, computed by one graph (views cloned first)."""
    with torch.no_grad():
        outs = [v.clone() if api.is_view(v) else v for v in values]
    xshard.sync()
    return [v.detach().cpu() for v in outs]


def views_of(program) -> list[bool]:
    """Which values are views at the end of a device run of ``program``."""
    values = run(program, xshard.device())
    flags = [api.is_view(v) for v in values]
    del values
    return flags


def check(program, expected=None) -> Outcome:
    """Runs ``program`` on xshard and compares with eager CPU (``expected``: its eager values).

    Raises ``InvalidProgram`` when eager PyTorch rejects it.
    """
    if expected is None:
        expected = run(program, "cpu")
    try:
        got = read_back(run(program, xshard.device()))
    except Exception as e:  # noqa: BLE001 - xshard raising where eager does not is a failure
        detail = f"{type(e).__name__}: {_one_line(e)}"
        if any(re.search(pattern, detail) for pattern in KNOWN_LIMITATIONS):
            return Outcome("limitation", detail)
        return Outcome("error", detail)
    for i, (g, w) in enumerate(zip(got, expected)):
        problem = _compare(g, w)
        if problem:
            return Outcome("mismatch", f"t{i}: {problem}", i)
    return Outcome("ok")


def check_sequence(programs) -> Outcome:
    """Clears the executable cache, runs ``programs`` in order; the last one's outcome."""
    expected = [run(p, "cpu") for p in programs]  # all valid, or InvalidProgram
    compiler.clear_cache()
    outcome = Outcome("ok")
    for p, e in zip(programs, expected):
        outcome = check(p, e)
    return outcome


def _one_line(e, limit=300) -> str:
    text = " ".join(str(e).split())
    return text[:limit] + ("..." if len(text) > limit else "")


# -- mutation: neighbours differing in one static argument -----------------------------------------


def literal_paths(step: Step):
    """(path, value) of every literal argument of ``step`` a mutation may change."""
    if step.kind in ("input", "sync"):
        return
    yield from _literals(step.args, ("args",))
    for i, (_, v) in enumerate(step.kwargs):
        yield from _literals(v, ("kwargs", i))


def _literals(obj, path):
    t = type(obj)
    if t is Ref or obj is DEVICE or obj is None or obj is Ellipsis or isinstance(obj, torch.dtype):
        return
    if t in (tuple, list):
        for i, v in enumerate(obj):
            yield from _literals(v, path + (i,))
        return
    if t is slice:
        for i, v in enumerate((obj.start, obj.stop, obj.step)):
            if v is not None:
                yield path + (i,), v
        return
    if t in (int, float, bool, str):
        yield path, obj


def get_path(step: Step, path):
    obj = step.args if path[0] == "args" else step.kwargs[path[1]][1]
    for i in path[1 if path[0] == "args" else 2:]:
        obj = (obj.start, obj.stop, obj.step)[i] if type(obj) is slice else obj[i]
    return obj


def set_path(step: Step, path, value) -> Step:
    def put(obj, rest):
        if not rest:
            return value
        i, rest = rest[0], rest[1:]
        if type(obj) is slice:
            parts = [obj.start, obj.stop, obj.step]
            parts[i] = put(parts[i], rest)
            return slice(*parts)
        items = list(obj)
        items[i] = put(items[i], rest)
        return type(obj)(items)

    if path[0] == "args":
        return step.replace(args=put(step.args, path[1:]))
    kwargs = list(step.kwargs)
    name, v = kwargs[path[1]]
    kwargs[path[1]] = (name, put(v, path[2:]))
    return step.replace(kwargs=tuple(kwargs))


# Values that compare or hash alike in Python but mean different programs: the neighbours that an
# inexact cache key confuses (hash(-1) == hash(-2); 1 == 1.0 == True).
_ENUMS = [("floor", "trunc"), ("tanh", "none"), ("mean", "sum", "none"), ("left", "right"),
          ("reflect", "replicate", "circular")]


def alternatives(value):
    """Neighbouring values of a literal, the most cache-confusable first."""
    t = type(value)
    if t is bool:
        return [not value, int(value)]
    if t is int:
        out = {-1: [-2], -2: [-1]}.get(value, [])
        out += [value - 1, value + 1, -value, int(value == 0) if value in (0, 1) else value // 2]
        if value in (0, 1):
            out.append(bool(value))
        out.append(float(value))
        return [v for v in dict.fromkeys(out)
                if v is not value and (type(v) is not int or v != value)]
    if t is float:
        out = {-1.0: [-2.0], -2.0: [-1.0]}.get(value, [])
        out += [-value, value * 2, value / 2, value + 1.0]
        if value.is_integer() and abs(value) < 1e6:
            out.append(int(value))
        return [v for v in out if type(v) is not float or v.hex() != value.hex()]
    if t is str:
        for group in _ENUMS:
            if value in group:
                return [v for v in group if v != value]
    return []


def mutants(program, rng: random.Random, count: int, tries: int = 20) -> list:
    """Up to ``count`` valid programs, each differing from ``program`` in one literal argument."""
    sites = [(i, path, v) for i, step in enumerate(program) for path, v in literal_paths(step)]
    out = []
    for _ in range(tries):
        if len(out) >= count or not sites:
            break
        i, path, value = rng.choice(sites)
        options = alternatives(value)
        if not options:
            continue
        new = options[0] if rng.random() < 0.5 else rng.choice(options)
        candidate = program[:i] + (set_path(program[i], path, new),) + program[i + 1:]
        try:
            run(candidate, "cpu")
        except InvalidProgram:
            continue
        out.append(candidate)
    return out


# -- shrinking -------------------------------------------------------------------------------------


def _refs(obj):
    if type(obj) is Ref:
        yield obj.index
    elif type(obj) in (tuple, list):
        for v in obj:
            yield from _refs(v)
    elif type(obj) is slice:
        for v in (obj.start, obj.stop, obj.step):
            yield from _refs(v)


def _step_refs(step: Step):
    yield from _refs(step.args)
    for _, v in step.kwargs:
        yield from _refs(v)


def _renumber(obj, mapping):
    if type(obj) is Ref:
        return Ref(mapping[obj.index])
    if type(obj) in (tuple, list):
        return type(obj)(_renumber(v, mapping) for v in obj)
    if type(obj) is slice:
        return slice(*(_renumber(v, mapping) for v in (obj.start, obj.stop, obj.step)))
    return obj


def drop_step(program, index: int):
    """``program`` without step ``index`` and every step that reads what it produced (or what
    those produce)."""
    dropped_values = set()
    keep, mapping = [], {}
    value = 0
    for i, step in enumerate(program):
        n = step.n_out or 0
        reads_dropped = any(r in dropped_values for r in _step_refs(step))
        if i == index or reads_dropped:
            dropped_values.update(range(value, value + n))
        else:
            for j in range(n):
                mapping[value + j] = value + j - len([d for d in dropped_values if d < value + j])
            keep.append(step)
        value += n
    out = []
    for step in keep:
        out.append(step.replace(args=_renumber(step.args, mapping),
                                kwargs=tuple((k, _renumber(v, mapping)) for k, v in step.kwargs)))
    return tuple(out)


def _simpler(value):
    """Simpler literals to try in place of ``value``, simplest first."""
    t = type(value)
    if t is bool:
        return [False] if value else []
    if t is int:
        out = [0, 1, -1, value // 2, value - 1 if value > 0 else value + 1]
        return [v for v in dict.fromkeys(out) if abs(v) < abs(value) or (v >= 0 > value and
                                                                         -v == value)]
    if t is float:
        if not math.isfinite(value):
            return [0.0, 1.0, -1.0]
        out = [0.0, 1.0, -1.0, float(round(value)), value / 2]
        return [v for v in dict.fromkeys(out) if abs(v) < abs(value) or
                (v == round(v) and value != round(value))]
    return []


def _narrowed(data: torch.Tensor):
    for dim, size in enumerate(data.shape):
        if size > 1:
            yield data.narrow(dim, 0, size - 1).clone()
            yield data.narrow(dim, 1, size - 1).clone()


def _plainer(data: torch.Tensor):
    """Simpler contents for an input: all zeros, then smaller values."""
    if data.numel() == 0 or not bool(data.any()):
        return
    yield torch.zeros_like(data)
    if data.dtype == torch.bool:
        return
    if data.dtype.is_floating_point:
        finite = data.nan_to_num(0.0, 1.0, -1.0)
        if not torch.equal(finite.round(), data):
            yield finite.round()
            return
    smaller = data.div(2, rounding_mode="trunc")
    if not torch.equal(smaller, data):
        yield smaller


def _metas(program):
    try:
        _, values = settle(program)
    except InvalidProgram:
        return None
    return [(tuple(v.shape), v.dtype) for v in values]


def shrink_moves(program):
    """Candidate simplifications of ``program`` as (description, new program)."""
    for i in reversed(range(len(program))):
        yield ("drop", i), drop_step(program, i)
    metas = _metas(program)
    if metas is not None:  # read an earlier value of the same shape and dtype instead
        for i, step in enumerate(program):
            for ref in sorted(set(_step_refs(step)), reverse=True):
                for earlier in range(ref):
                    if metas[earlier] == metas[ref]:
                        mapping = {k: k for k in range(len(metas))}
                        mapping[ref] = earlier
                        rerouted = step.replace(
                            args=_renumber(step.args, mapping),
                            kwargs=tuple((k, _renumber(v, mapping)) for k, v in step.kwargs))
                        yield ("reroute", i, ref, earlier), program[:i] + (rerouted,) + \
                            program[i + 1:]
                        break
    for i, step in enumerate(program):
        if step.kind == "input":
            for k, data in enumerate(_narrowed(step.data)):
                yield ("narrow", i, k), program[:i] + (step.replace(data=data),) + program[i + 1:]
            for k, data in enumerate(_plainer(step.data)):
                yield ("plain", i, k), program[:i] + (step.replace(data=data),) + program[i + 1:]
            if step.grad:
                yield ("nograd", i), program[:i] + (step.replace(grad=False),) + program[i + 1:]
            continue
        for j in range(len(step.kwargs)):
            kwargs = step.kwargs[:j] + step.kwargs[j + 1:]
            yield ("dropkw", i, j), program[:i] + (step.replace(kwargs=kwargs),) + program[i + 1:]
        for path, value in list(literal_paths(step)):
            for simple in _simpler(value):
                yield ("lit", i, path, simple), program[:i] + (
                    set_path(step, path, simple),) + program[i + 1:]


def _apply_move(program, move):
    """``move`` (a description from ``shrink_moves`` of another program) applied to ``program``."""
    for description, candidate in shrink_moves(program):
        if description == move:
            return candidate
    return None


def shrink(programs, outcome: Outcome, budget: int = 400):
    """A minimal sequence of programs still failing as ``outcome`` does (the last program).

    Greedy: drop programs of the sequence, then try each move of ``shrink_moves`` on the last
    program together with every program it applies to (so neighbours stay neighbours), then on the
    last program alone, then on each earlier one; keep any that still fails the same way.
    """
    programs = list(programs)
    calls = [0]

    def fails(candidate) -> bool:
        if calls[0] >= budget:
            return False
        calls[0] += 1
        try:
            got = check_sequence(candidate)
        except InvalidProgram:
            return False
        return got.failed and got.same_failure(outcome)

    progress = True
    while progress and calls[0] < budget:
        progress = False
        for k in range(len(programs) - 1):
            candidate = programs[:k] + programs[k + 1:]
            if fails(candidate):
                programs, progress = candidate, True
                break
        if progress:
            continue
        for move, _ in list(shrink_moves(programs[-1])):
            moved = [_apply_move(p, move) for p in programs]
            together = [p if m is None else m for p, m in zip(programs, moved)]
            alone = programs[:-1] + [moved[-1]]
            tried = [programs]
            for candidate in (together, alone):
                if candidate in tried or not all(candidate):
                    continue
                tried.append(candidate)
                if fails(candidate):
                    programs, progress = candidate, True
                    break
            if progress:
                break
        if progress:
            continue
        for k in range(len(programs) - 1):
            for move, smaller in shrink_moves(programs[k]):
                candidate = programs[:k] + [smaller] + programs[k + 1:]
                if smaller and fails(candidate):
                    programs, progress = candidate, True
                    break
            if progress:
                break
    return programs


def minimal_context(history, failing, outcome: Outcome, limit: int = 40):
    """The shortest prefix of programs (from ``history``, most similar first) after which
    ``failing`` fails as ``outcome`` does: [], one program, or (rarely) the recent history."""

    def fails(seq):
        try:
            got = check_sequence(seq)
        except InvalidProgram:
            return False
        return got.failed and got.same_failure(outcome)

    if fails([failing]):
        return []
    shape = _signature(failing)
    similar = [p for p in reversed(history) if _signature(p) == shape]
    others = [p for p in reversed(history[-limit:]) if _signature(p) != shape]
    for p in similar[:limit] + others:
        if fails([p, failing]):
            return [p]
    return list(history[-limit:])


def _signature(program):
    return tuple((s.kind, s.name, None if s.data is None else (tuple(s.data.shape), s.data.dtype))
                 for s in program)


# -- printing --------------------------------------------------------------------------------------


def _literal(obj) -> str:
    if type(obj) is Ref:
        return f"t{obj.index}"
    if obj is DEVICE:
        return "dev"
    if isinstance(obj, torch.dtype):
        return str(obj)
    if obj is Ellipsis:
        return "..."
    if type(obj) is tuple:
        inner = ", ".join(_literal(v) for v in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if type(obj) is list:
        return "[" + ", ".join(_literal(v) for v in obj) + "]"
    if type(obj) is slice:
        return f"slice({_literal(obj.start)}, {_literal(obj.stop)}, {_literal(obj.step)})"
    if type(obj) is float and not math.isfinite(obj):
        return f"float('{obj}')"
    if isinstance(obj, torch.memory_format):
        return str(obj)
    return repr(obj)


def _index_literal(index) -> str:
    parts = index if type(index) is tuple else (index,)

    def one(p):
        if type(p) is slice:
            text = ":".join("" if v is None else _literal(v) for v in (p.start, p.stop, p.step))
            return text[:-1] if p.step is None else text
        return _literal(p)

    text = ", ".join(one(p) for p in parts)
    if type(index) is tuple and len(index) == 1:
        text += ","
    return text or "()"


def _call_args(args, kwargs) -> str:
    parts = [_literal(a) for a in args] + [f"{k}={_literal(v)}" for k, v in kwargs]
    return ", ".join(parts)


def _data_literal(data: torch.Tensor, grad: bool = False) -> str:
    dtype = "" if data.dtype in (torch.float32, torch.bool) else f", dtype={data.dtype}"
    end = ", requires_grad=True)" if grad else ")"
    if data.numel() == 0:
        return f"torch.zeros({tuple(data.shape)}, dtype={data.dtype}, device=dev{end}"
    if data.dtype == torch.float32:
        values = np.vectorize(lambda v: float(str(np.float32(v))))(data.numpy()).tolist()
    else:
        values = data.tolist()
    text = repr(values).replace("nan", "float('nan')").replace("inf", "float('inf')")
    return f"torch.tensor({text}{dtype}, device=dev{end}"


def step_lines(step: Step, first_value: int) -> list[str]:
    outs = [f"t{first_value + j}" for j in range(step.n_out or 0)]
    target = ", ".join(outs) + ("," if step.unpack and len(outs) == 1 else "") + " = "
    target = target if outs else ""
    if step.kind == "input":
        return [f"{target}{_data_literal(step.data, step.grad)}"]
    if step.kind == "sync":
        return ["xshard.sync()"]
    if step.kind == "torch":
        return [f"{target}torch.{step.name}({_call_args(step.args, step.kwargs)})"]
    if step.kind == "method":
        return [f"{target}{_literal(step.args[0])}.{step.name}("
                f"{_call_args(step.args[1:], step.kwargs)})"]
    if step.kind == "getitem":
        return [f"{target}{_literal(step.args[0])}[{_index_literal(step.args[1])}]"]
    if step.kind == "attr":
        return [f"{target}{_literal(step.args[0])}.{step.name}"]
    if step.kind == "setitem":
        return [f"{_literal(step.args[0])}[{_index_literal(step.args[1])}] = "
                f"{_literal(step.args[2])}"]
    if step.kind == "opinfo":
        return [f"{target}opinfo({step.name!r})({_call_args(step.args, step.kwargs)})"]
    raise ValueError(step.kind)


def program_source(program, name: str, views=None) -> str:
    lines = [f"def {name}(dev):"]
    value = 0
    for step in program:
        for line in step_lines(step, value):
            lines.extend(textwrap.wrap(line, 100, initial_indent="    ",
                                       subsequent_indent="        ", break_long_words=False,
                                       break_on_hyphens=False))
        value += step.n_out or 0
    views = views or [False] * value
    outs = [f"t{i}.clone()" if views[i] else f"t{i}" for i in range(value)]
    lines.extend(textwrap.wrap("return [" + ", ".join(outs) + "]", 100, initial_indent="    ",
                               subsequent_indent="        "))
    return "\n".join(lines)


_OPINFO_HELPER = '''
def opinfo(name):  # "op_name.variant|function" or "...|inplace": an OpInfo's callable
    from torch.testing._internal.common_methods_invocations import op_db
    full, variant = name.split("|")
    for op in op_db:
        if op.name + ("." + op.variant_test_name if op.variant_test_name else "") == full:
            return op.op if variant == "function" else op.inplace_variant
    raise KeyError(name)
'''


def to_python(programs, outcome: Outcome, header: str = "") -> str:
    """A runnable script reproducing a failure of the last of ``programs``."""
    names = [f"program_{i + 1}" for i in range(len(programs))]
    parts = [f"# {header}" if header else "",
             "# xshard differs from eager CPU PyTorch on the last program below, run after the "
             "ones before it in one process (they share xshard's executable cache).",
             "import torch", "import xshard", ""]
    if any(s.kind == "opinfo" for p in programs for s in p):
        parts.append(_OPINFO_HELPER)
    for p, name in zip(programs, names):
        try:
            views = views_of(p)
        except Exception:  # noqa: BLE001 - the failure may be an error in this very run
            views = None
        parts += [program_source(p, name, views), "", ""]
    parts += ["dev = xshard.device()",
              f"for program in ({', '.join(names)},):",
              "    for i, (got, want) in enumerate(zip(program(dev), program('cpu'))):",
              "        torch.testing.assert_close(got.cpu(), want, equal_nan=True, "
              "rtol=1e-4, atol=1e-5, msg=f'{program.__name__}: t{i} differs')",
              "", f"# {names[-1]}, {outcome.kind}: " + outcome.detail.replace("\n", "\n# ")]
    return "\n".join(p for p in parts if p is not None)


# -- the driver ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    programs: list
    outcome: Outcome
    seed: int
    index: int

    def report(self) -> str:
        return to_python(self.programs, self.outcome,
                         header=f"differential failure: seed {self.seed}, program {self.index}")


@dataclasses.dataclass
class Stats:
    programs: int = 0
    families: int = 0
    steps: int = 0
    invalid: int = 0
    limitations: int = 0


def fuzz(seed: int, families: int, *, neighbours: int = 2, max_failures: int = 2,
         shrink_budget: int = 300, stats: Stats | None = None) -> list[Failure]:
    """Generates ``families`` random programs, each followed by up to ``neighbours`` programs
    differing from it in one literal, runs them all in one process and returns the failures,
    shrunk. Deterministic for a seed (the executable cache is cleared first)."""
    from differential_ops import generate

    rng = random.Random(seed)
    stats = stats if stats is not None else Stats()

    def programs():
        for _ in range(families):
            base = generate(rng)
            if base is None:
                stats.invalid += 1
                continue
            yield [base] + mutants(base, rng, neighbours)

    return run_families(programs(), seed, max_failures=max_failures,
                        shrink_budget=shrink_budget, stats=stats)


def run_families(families, seed=None, *, max_failures: int = 2, shrink_budget: int = 300,
                 stats: Stats | None = None) -> list[Failure]:
    """Runs each family (a list of programs) in order in this process; the failures, shrunk."""
    stats = stats if stats is not None else Stats()
    compiler.clear_cache()
    history: list = []
    failures: list = []
    for family in families:
        stats.families += 1
        for program in family:
            stats.programs += 1
            stats.steps += len(program)
            outcome = check(program)
            history.append(program)
            stats.limitations += outcome.kind == "limitation"
            if outcome.failed:
                context = minimal_context(history[:-1], program, outcome)
                small = shrink(context + [program], outcome, budget=shrink_budget)
                failure = Failure(small, check_sequence(small), seed, stats.programs)
                if failure.report() not in {f.report() for f in failures}:
                    failures.append(failure)
                compiler.clear_cache()
                if len(failures) >= max_failures:
                    return failures
                break  # the family's other programs would most likely fail alike
    return failures
