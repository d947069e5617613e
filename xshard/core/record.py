"""Recording: an aten call on xshard tensors becomes IR nodes; nothing runs.

A call's arguments are frozen once into a static template (tensors and dynamic scalars become
``Slot``s into the node's inputs) and a key that spells out every static value exactly, every
argument's type and every tensor's shape, stride and dtype. The key finds, in one lookup, PyTorch's
own meta-kernel result for the call (output shapes, strides, dtypes: type promotion and
broadcasting exactly as eager) and the node's interned key (see [Note: exact keys] in
xshard.core.ir).

In-place ops are recorded as their functional twin's node from the same freezing and written into
their targets (see [Note: cells and views] in xshard.core.cells); the dispatcher is not re-entered.
"""

from __future__ import annotations

import warnings

import torch
from torch._prims_common import suggest_memory_format
from torch.utils._pytree import tree_leaves, tree_map

from xshard.core import ir, rng
from xshard.core.backend import DEVICE_TYPE
from xshard.core.cells import LazyTensor, ViewStep
from xshard.core.dtypes import UnsupportedDtypeError, overflows, to_numpy_dtype
from xshard.core.execute import upload_node
from xshard.core.ops import META_ARGUMENTS, NO_DEFAULT, facts

aten = torch.ops.aten
_WEAK = ir.WEAK


class DeviceMismatchError(RuntimeError):
    pass


# -- freezing arguments into a static template plus inputs ------------------------------------------

_SCALAR_TYPES = (bool, int, float, complex)


class Frozen:
    """A call's graph inputs, and the exact key of its static part, collected while its arguments
    are frozen into a template.

    With ``nodes=False`` only the key is built: no input node is made (no view replayed, no CPU
    tensor read), for calls that only need the metadata.
    """

    __slots__ = ("inputs", "key", "nodes", "index_args", "numbers")

    def __init__(self, code, nodes=True, index_args=False):
        self.inputs = []
        self.key = [code]
        self.nodes = nodes
        self.index_args = index_args
        self.numbers = False  # whether a tensor standing for a Python number was passed

    def tensor(self, t):
        inputs = self.inputs
        if isinstance(t, LazyTensor):
            if t._chain:
                inputs.append(t._value() if self.nodes else None)
                self.key.append(t._meta)
            else:
                value = t._cell.value
                inputs.append(value if self.nodes else None)
                if value.op is _WEAK:  # see [Note: numbers in a graph]
                    self.numbers = True
                    self.key.append(("number", value.dtype))
                else:
                    self.key.append(t._meta)
        elif t.device.type == "cpu" and t.dim() == 0:
            # A 0-dim CPU tensor, allowed with device tensors as on CUDA: a strongly typed scalar
            # input (its value read now, as eager reads it at the call), not an upload.
            inputs.append(ir.scalar_node(t.item(), t.dtype) if self.nodes else None)
            self.key.append(("cpu0", t.dtype))
        elif self.index_args and t.device.type == "cpu":
            # An index tensor on the CPU, allowed as on CUDA: uploaded.
            inputs.append(upload_node(t) if self.nodes else None)
            self.key.append(("cpu", t.shape, t.dtype))
        else:
            raise DeviceMismatchError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{DEVICE_TYPE}:0 and {t.device} (a tensor of shape {tuple(t.shape)}). Move it "
                f"with t.to(xshard.device()) first; only 0-dim CPU tensors, and CPU index "
                f"tensors, may be mixed with device tensors.")
        n = len(inputs) - 1
        return _SLOTS[n] if n < 64 else ir.slot(n)

    def freeze(self, x, dynamic=None):
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        t = type(x)
        if t is list or t is tuple:
            # Nesting is spelled out, and each static value's type (True == 1 and hash equally,
            # yet sum(x, [0, 1]) and sum(x, [0], True) differ).
            self.key.append(("seq", t, len(x)))
            if x and isinstance(x[0], torch.Tensor):
                tensor = self.tensor
                return tuple([tensor(v) if isinstance(v, torch.Tensor) else self.freeze(v)
                              for v in x])
            if dynamic is not None and x and all(type(v) in _SCALAR_TYPES for v in x):
                return tuple([self.freeze(v, dynamic) for v in x])
            return tuple([self.freeze(v) for v in x])
        if dynamic is not None and t in _SCALAR_TYPES:
            default = dynamic[0]
            if default is NO_DEFAULT or x != default or t is not type(default):
                self.inputs.append(ir.scalar_node(x) if self.nodes else None)
                self.key.append(t)
                return ir.slot(len(self.inputs) - 1)
        if t is int or t is bool:
            self.key.append((t, x))
        elif t is torch.Generator:
            raise TypeError(
                "xshard random ops draw from the device's own stream; pass generator=None and seed "
                "it with torch.manual_seed(seed).")
        else:
            self.key.append(ir.exact(x))
        return x


_SLOTS = [ir.slot(i) for i in range(64)]


def freeze_call(f, args, kwargs, nodes=True, code=None):
    """``(template, Frozen)`` of a call of the op whose facts are ``f``. ``code``: the op the key
    names (an in-place op's key under its functional twin)."""
    rec = Frozen(f.code if code is None else code, nodes, bool(f.cpu_index_names))
    dyn = f.positional_dynamic
    n = len(dyn)
    index_positions = f.cpu_index_positions
    targs = []
    for i, a in enumerate(args):
        rec.index_args = i in index_positions
        targs.append(rec.freeze(a, dyn[i] if i < n else None))
    tkwargs = []
    if kwargs:
        for k, v in kwargs.items():
            if k == "generator" and v is None:
                continue
            rec.key.append(k)
            rec.index_args = k in f.cpu_index_names
            tkwargs.append((k, rec.freeze(v, f.kw_dynamic.get(k))))
    return (tuple(targs), tuple(tkwargs)), rec


# -- meta inference -----------------------------------------------------------------------------

# default dtype -> {frozen call key -> (output spec, interned node key)}: what PyTorch infers
# depends on the default dtype too (``torch.full(s, 1.1)``, ``int_tensor * 1.5``).
_META: dict = {}


def _cache(caches: dict) -> dict:
    """The part of ``caches`` for the current default dtype."""
    default = torch.get_default_dtype()
    cache = caches.get(default)
    if cache is None:
        cache = caches[default] = {}
    return cache


def to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("meta")
    return x


def meta(func, args, kwargs, key: tuple, numbers: bool = False):
    """``(spec, node key)`` of a call: the output spec PyTorch's meta kernel gives (``("t", shape,
    stride, dtype, offset)``, ``("seq", type, specs)`` or ``("const", value)``), cached by ``key``.
    ``numbers``: whether tensors standing for Python numbers were passed (see [Note: numbers in a
    graph])."""
    cache = _cache(_META)
    entry = cache.get(key)
    if entry is None:
        if numbers:
            return _number_meta(func, args, kwargs, key, cache)
        args, kwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
        adapt = META_ARGUMENTS.get(func)
        if adapt is not None:
            args, kwargs = adapt(args, kwargs)
        out = func(*args, **kwargs)
        _check_supported(func, out)
        entry = cache[key] = (_describe(out),
                              ir.intern_key(("call", key, torch.get_default_dtype())))
    return entry


# [Note: numbers in a graph]
# A compiled step's Python number argument (xshard.step) is a value of the graph, fed anew on each
# call, yet eager computes with a Python number: ``bf16_0d * s`` stays bfloat16, ``uint8_0d * 3``
# wraps around in uint8, a float64 model multiplies by ``s`` itself, and ``1 - s`` is Python's
# float64 arithmetic. So such a value is a ``WEAK`` node (float64, int64, bool or complex128, the
# number's own precision) and a tensor holding one, unviewed, stands for a number where ops read
# it:
# - PyTorch's meta kernel infers the call with the Python number itself where the op takes one:
#   the arithmetic ops that accept numbers for tensors (``mul``, ``add``, ``div``...: PyTorch's
#   own list), else the overload of the same op taking a ``Scalar`` there (``pow.Tensor_Tensor``
#   as ``pow.Tensor_Scalar``, ``gt.Tensor`` as ``gt.Scalar``, ``clamp.Tensor``, ``where.self`` as
#   ``where.ScalarOther``): what eager's call with the number dispatches to. An op with neither
#   (``maximum``, which eager refuses a number) takes a 0-dim tensor of the default dtype (int64
#   for an int).
# - An op whose tensors all stand for numbers computes as Python does: in float64 or int64
#   (``n / 2`` is a float), and its 0-dim result of such a dtype is a number too.
# The lowering rules already promote weakly typed values as numbers (table.is_weak): the WEAK
# node's lowering marks the value weak for JAX, and each result is cast to the meta kernel's
# dtype. A view of such a tensor, or a tensor it was copied into, is an ordinary tensor.


def _number_meta(func, args, kwargs, key, cache):
    """``meta`` of a call passed tensors that stand for Python numbers (see [Note: numbers in a
    graph])."""
    default = torch.get_default_dtype()
    if _numbers_alone(args, kwargs):  # Python's arithmetic: in float64 (``n / 2`` too) or int64
        as_meta, infer_in = _as_tensor, torch.float64
    elif torch._C._should_allow_numbers_as_tensors(func._schema.name.split("::")[-1]):
        as_meta, infer_in = _as_python, default
    else:  # the overload eager's call with the number dispatches to, if the op has one
        scalar = _scalar_overload(func, args, kwargs)
        infer_in = default
        if scalar is None:
            as_meta = _as_default_tensor
        else:
            func, as_meta = scalar, _as_python
    args, kwargs = tree_map(as_meta, args), tree_map(as_meta, kwargs)
    args, kwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
    torch.set_default_dtype(infer_in)
    try:
        out = func(*args, **kwargs)
    finally:
        torch.set_default_dtype(default)
    _check_supported(func, out)
    entry = cache[key] = (_describe(out), ir.intern_key(("call", key, default)))
    return entry


def is_number(x) -> bool:
    """Whether ``x`` is a tensor standing for a Python number (see [Note: numbers in a graph])."""
    return isinstance(x, LazyTensor) and not x._chain and x._cell.value.op is _WEAK


def _numbers_alone(args, kwargs) -> bool:
    """Whether every tensor of a call stands for a number."""
    return not any(isinstance(x, torch.Tensor) and not is_number(x)
                   for x in tree_leaves((args, kwargs)))


def number_result(node, spec, args, kwargs):
    """``node``, the result of a call passed numbers, as a number when the call's tensors all
    stand for numbers and it is a 0-dim value of a number's dtype."""
    if spec[0] == "t" and not spec[1] and spec[3] in ir.NUMBER_TYPES and \
            _numbers_alone(args, kwargs):
        return ir.weak(node)
    return node


def _as_python(x):
    """A number's tensor as a Python number of its type (its value does not change what the meta
    kernel infers)."""
    return ir.NUMBER_TYPES[x.dtype](1) if is_number(x) else x


def _as_tensor(x):
    return torch.empty((), dtype=x.dtype, device="meta") if is_number(x) else x


def _as_default_tensor(x):
    if not is_number(x):
        return x
    default = torch.get_default_dtype()
    if x.dtype == torch.float64:
        dtype = default
    elif x.dtype == torch.complex128:
        dtype = torch.complex128 if default == torch.float64 else torch.complex64
    else:  # int64, bool
        dtype = x.dtype
    return torch.empty((), dtype=dtype, device="meta")


def _scalar_overload(func, args, kwargs):
    """The overload of ``func``'s op taking a ``Scalar`` where ``func`` takes each tensor that
    stands for a number, and the same arguments elsewhere (``pow.Tensor_Tensor`` for
    ``x ** s`` -> ``pow.Tensor_Scalar``; ``_foreach_div_.Tensor(self, other)`` ->
    ``_foreach_div_.Scalar(self, scalar)``, a number passed by position), else None."""
    schema = func._schema.arguments
    passed = dict(zip((a.name for a in schema), args))
    passed.update(kwargs)
    numbers = {a.name for a in schema if is_number(passed.get(a.name))}
    want = [(a.name, str(a.type).replace("Tensor", "number") if a.name in numbers
             else str(a.type)) for a in schema]
    renamable = numbers - kwargs.keys()
    packet = func.overloadpacket
    for name in packet.overloads():
        overload = getattr(packet, name)
        have = [(a.name, str(a.type)) for a in overload._schema.arguments]
        if len(have) == len(want) and all(
                h[1] == w[1] and (h[0] == w[0] or w[0] in renamable)
                for h, w in zip(have, want)):
            return overload
    return None


def check_range(func, f, args, kwargs, dtype) -> None:
    """Raises where eager's kernel does: a number argument ``f.range_checked`` names that does not
    fit ``dtype``, the result's (``fill_(300)`` on uint8; XLA would wrap it to 44)."""
    for position, name in f.range_checked:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, (int, float)) and overflows(value, dtype):
            raise RuntimeError(
                f"{func}: value cannot be converted to type {dtype} without overflow: {name}="
                f"{value!r} (as in eager); use a value within {dtype}'s range, or a wider dtype.")


def _check_supported(func, out) -> None:
    """Raises at the call (not at the next sync) when a result's dtype has no XLA counterpart
    (complex32)."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, torch.Tensor):
            try:
                to_numpy_dtype(t.dtype)
            except UnsupportedDtypeError as e:
                raise UnsupportedDtypeError(f"{func} gives a {t.dtype} result: {e}") from None


def _describe(out):
    if isinstance(out, torch.Tensor):
        return ("t", tuple(out.shape), tuple(out.stride()), out.dtype, out.storage_offset())
    if isinstance(out, (list, tuple)):
        return ("seq", type(out), tuple(_describe(o) for o in out))
    return ("const", out)


class NoMeta(Exception):
    """PyTorch has no meta kernel for the call, or its output shape depends on data."""


def record(func, f, args, kwargs):
    """Records a functional op with a lowering rule: ``(spec, node)`` (``node`` None for a
    non-tensor result). Raises ``NoMeta`` when PyTorch cannot tell the output without data."""
    template, rec = freeze_call(f, args, kwargs)
    key = tuple(rec.key)
    try:
        spec, node_key = meta(func, args, kwargs, key, rec.numbers)
    except (NotImplementedError, torch._subclasses.fake_tensor.DataDependentOutputException,
            ZeroDivisionError) as e:
        # (A meta kernel that divides by an element count fails on empty inputs that eager
        # takes: ``mse_loss_backward`` of a mean over no element.)
        raise NoMeta(str(e)) from e
    if f.range_checked and spec[0] == "t":
        check_range(func, f, args, kwargs, spec[3])
    node = _node(func, f, tuple(rec.inputs), template, spec, node_key)
    return spec, number_result(node, spec, args, kwargs) if rec.numbers else node


def _node(func, f, inputs, template, spec, node_key):
    if f.random:
        inputs = inputs + (rng.next_key(),)
        template = (template[0], template[1] + (("_key", ir.slot(len(inputs) - 1)),))
    kind = spec[0]
    if kind == "t":
        return ir.Node(func, inputs, template, spec[1], spec[3], key=node_key)
    if kind == "seq":
        metas = tuple((o[1], o[3]) if o[0] == "t" else None for o in spec[2])
        return ir.Node(func, inputs, template, outputs=metas, key=node_key)
    return None


# -- mutation ----------------------------------------------------------------------------------------


def mutate(func, f, args, kwargs):
    """In-place, out= and other mutating ops: the functional twin's result written into the
    arguments it writes. Returns what the op returns, or ``NotImplemented`` when there is no
    functional twin (the caller falls back)."""
    functional = f.functional
    if functional is None:
        return NotImplemented
    if f.inplace and _aliased_list(args, kwargs):
        return _one_by_one(func, args, kwargs)
    if f.inplace_twin:
        return _inplace(func, f, functional, args, kwargs)
    bound = _bind(func, args, kwargs)
    # Let PyTorch's meta kernel validate the call (broadcast into self, dtype cast rules, overlap).
    _, rec = freeze_call(f, args, kwargs, nodes=False)
    try:
        if f.out_names:  # an out= of another shape is resized below, with its one warning
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "An output with one or more elements")
                meta(func, args, kwargs, tuple(rec.key), rec.numbers)
        else:
            meta(func, args, kwargs, tuple(rec.key), rec.numbers)
    except NotImplementedError:
        pass
    if f.out_names:
        fargs = {k: v for k, v in bound.items() if k not in f.out_names}
        if not any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
                isinstance(x, torch.Tensor) for x in v)) for v in fargs.values()):
            # A factory's out= form (e.g. arange into an empty device tensor): make it here.
            first_out = bound[f.out_names[0]]
            fargs.setdefault("dtype", first_out.dtype)
            fargs["device"] = first_out.device
        result = functional(**fargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        outs = [bound[name] for name in f.out_names]
        for dst, src in zip(outs, results):
            if isinstance(src, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
                _resize_out(dst, src)
            write(dst, _value_of(src))
        return outs[0] if len(outs) == 1 else tuple(outs)
    if f.inplace:
        if _first_argument(functional) != "self":  # polygamma_(self, n) vs polygamma(n, self)
            result = functional(**bound)
        else:
            # Defaults made explicit pick the matching overload: bernoulli_(p=0.5) -> bernoulli.p.
            result = functional(*_with_defaults(func, args), **kwargs)
        if len(f.written) > 1 and isinstance(result, tuple) and len(result) == len(f.written):
            # ``_fused_adam_``: each list it updates, in order (``rrelu_with_noise``, whose
            # "functional" form writes its noise itself, returns one tensor)
            for name, new in zip(f.written, result):
                _write_results(bound[name], new)
            # ``_amp_update_scale_`` returns its first argument; ``_fused_adam_`` returns nothing
            return bound[f.written[0]] if func._schema.returns else None
        return _write_results(args[0], result)
    # A functional twin returns the op's own outputs followed by the new value of each written arg.
    result = functional(**bound)
    n_written = len(f.written)
    for name, new in zip(f.written, result[len(result) - n_written:]):
        write(bound[name], _value_of(new))
    own = result[: len(result) - n_written]
    return own[0] if len(own) == 1 else tuple(own)


def _resize_out(out, result) -> None:
    """An out= tensor of another shape is resized to the result's, never broadcast into, as
    ATen's ``resize_output`` does (with its warning when ``out`` had elements)."""
    if out.numel():
        warnings.warn(
            f"An out= tensor of shape {list(out.shape)} was resized to the result's shape "
            f"{list(result.shape)}, as PyTorch does (deprecated there for outputs with elements). "
            f"Pass an out tensor of the result's shape, or one of zero elements (t.resize_(0)).",
            UserWarning, stacklevel=4)
    out.resize_(result.shape, memory_format=suggest_memory_format(result))


def _aliased_list(args, kwargs) -> bool:
    """Whether an in-place op writes a list (``_foreach_add_``) in which two tensors share
    storage (``_foreach_add_([t, t], 1)``), or one of them is read from another list argument
    (``_foreach_div_([t, u], [t, t])``)."""
    targets = args[0] if args else None
    if type(targets) not in (list, tuple) or len(targets) < 2:
        return False
    ids = [id(t._cell) for t in targets if isinstance(t, LazyTensor)]
    cells = set(ids)
    if len(cells) < len(ids):
        return True
    return any(isinstance(t, LazyTensor) and id(t._cell) in cells
               for a in (*args[1:], *kwargs.values()) if isinstance(a, (list, tuple)) for t in a)


def _one_by_one(func, args, kwargs):
    """An in-place ``_foreach_`` op over an aliased list (see ``_aliased_list``), element by
    element: each update then reads the writes of those before it, as eager's loop does."""
    n = len(args[0])

    def item(x, i):
        return [x[i]] if isinstance(x, (list, tuple)) and len(x) == n else x

    for i in range(n):
        func(*(item(a, i) for a in args), **{k: item(v, i) for k, v in kwargs.items()})
    return None


def _inplace(func, f, functional, args, kwargs):
    """``x.op_(...)`` as the node of ``op(x, ...)`` written into ``x``: one freezing, no tensor
    made, the dispatcher not re-entered."""
    ff = facts(functional)
    template, rec = freeze_call(f, args, kwargs)
    key = tuple(rec.key)
    cache = _cache(_INPLACE)
    entry = cache.get(key)
    if entry is None:
        meta(func, args, kwargs, key, rec.numbers)  # PyTorch's checks: broadcast, casts
        entry = meta(functional, args, kwargs, (ff.code,) + key[1:], rec.numbers)
        if func not in _IN_OWN_DTYPE:
            _check_cast(entry[0], args[0])
        cache[key] = entry
    if f.range_checked:  # after the cast check, as in eager
        check_range(func, f, args, kwargs, args[0].dtype)
    spec, node_key = entry
    node = _node(functional, ff, tuple(rec.inputs), template, spec, node_key)
    if rec.numbers:
        node = number_result(node, spec, args, kwargs)
    target = args[0]
    if spec[0] == "seq":
        for i, dst in enumerate(target):
            write(dst, ir.output_node(node, i))
        return None
    write(target, node)
    return target


# as _META: in-place call key -> (the functional twin's output spec, its node key)
_INPLACE: dict = {}


# In-place ops that compute in the written tensor's dtype (``cumsum_(self, dim)`` is
# ``cumsum(self, dim, dtype=self.dtype)``): nothing to check.
_IN_OWN_DTYPE = frozenset({torch.ops.aten.cumsum_.default, torch.ops.aten.cumprod_.default})


def _check_cast(spec, target) -> None:
    """An in-place op's result (output ``spec`` of its functional twin) must cast to the written
    tensor's dtype as ATen's kernels require (``bool.mul_(3)``, ``int.div_(2)``); the meta kernels
    do not check it."""
    if spec[0] == "seq":
        for s, t in zip(spec[2], target):
            _check_cast(s, t)
    elif spec[0] == "t":
        _check_dtypes(spec[3], target.dtype)


def _check_dtypes(result, output) -> None:
    """Raises PyTorch's error where dtype ``result`` may not be written into dtype ``output``."""
    if not torch.can_cast(result, output):
        raise RuntimeError(f"result type {_dtype_name(result)} can't be cast to the desired "
                           f"output type {_dtype_name(output)}")


def _dtype_name(dtype) -> str:
    """PyTorch's name of a dtype in its messages: Float, Long, Bool, Half, BFloat16."""
    return torch.empty((), dtype=dtype, device="meta").type().split(".")[-1].replace(
        "Tensor", "")


def _write_results(target, result):
    """An in-place op's result written into its input(s), as ATen's casts allow."""
    if isinstance(target, (list, tuple)):
        for dst, src in zip(target, result):
            _check_dtypes(src.dtype, dst.dtype)
            write(dst, _value_of(src))
        return None
    _check_dtypes(result.dtype, target.dtype)
    write(target, _value_of(result))
    return target


def _value_of(src) -> ir.Node:
    if isinstance(src, LazyTensor):
        return src._value()
    if isinstance(src, torch.Tensor) and src.device.type == "cpu":
        return upload_node(src)
    raise DeviceMismatchError(f"cannot write a {type(src).__name__} into an xshard tensor")


def write(dst, value: ir.Node) -> None:
    """Writes ``value`` into tensor ``dst`` as an in-place op would (cast to dst's dtype)."""
    if not isinstance(dst, LazyTensor):
        raise DeviceMismatchError(
            f"Cannot write an xshard result into a {dst.device} tensor in place; move it with "
            f".to(xshard.device()) first.")
    shape, _, dtype = dst._meta
    if value.shape != shape:
        if tuple(value.shape) != shape:
            if shape != tuple(torch.broadcast_shapes(value.shape, shape)):
                raise RuntimeError(
                    f"xshard cannot resize an out= tensor of shape {shape} to "
                    f"{tuple(value.shape)}; pass an out tensor of the result's shape, or use the "
                    f"functional form.")
            value = expand(value, shape)
    if value.dtype is not dtype:
        value = convert(value, dtype)
    if dst._chain:
        dst._assign(value)
    else:
        dst._cell.write(value)


def _first_argument(op) -> str:
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = getattr(op, op.overloads()[0])
    schema = op._schema
    return schema.arguments[0].name if schema.arguments else ""


def _with_defaults(func, args) -> tuple:
    """``args`` followed by the schema defaults of the positional arguments it leaves out."""
    rest = [a for a in func._schema.arguments if not a.kwarg_only][len(args):]
    if not rest or not all(a.has_default_value() for a in rest):
        return tuple(args)
    return tuple(args) + tuple(a.default_value for a in rest)


def _bind(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def expand(value: ir.Node, shape) -> ir.Node:
    shape = tuple(shape)
    return ir.Node(aten.expand.default, (value,), ((ir.slot(0), shape), ()), shape, value.dtype)


def convert(value: ir.Node, dtype) -> ir.Node:
    return ir.Node(aten._to_copy.default, (value,), ((ir.slot(0),), (("dtype", dtype),)),
                   value.shape, dtype)


def clone(value: ir.Node) -> ir.Node:
    return ir.Node(aten.clone.default, (value,), ((ir.slot(0),), ()), value.shape, value.dtype)


# -- views -----------------------------------------------------------------------------------------


_VIEWS: dict = {}


def view_steps(func, f, args, kwargs):
    """The views a view op makes of ``args[0]``: a list of ``(ViewStep, spec)`` (one per output),
    a single one for a single output; or ``None`` when the op must be recorded as a value (a
    tensor-valued argument, which aliasing cannot follow). Cached by the call's key."""
    template, rec = freeze_call(f, args, kwargs, nodes=False)
    key = tuple(rec.key)
    made = _VIEWS.get(key)
    if made is None:
        made = _VIEWS[key] = _view_steps(func, args, kwargs, template, rec, key)
    return made or None


def _view_steps(func, args, kwargs, template, rec, key):
    base = args[0]
    spec, _ = meta(func, args, kwargs, key)
    if len(rec.inputs) != 1:
        return ()
    if spec[0] == "t":
        return _step(base, func, template, spec), spec
    # split / split_with_sizes / unbind: each output is a slice or select of the base.
    dim = _bind(func, args, kwargs).get("dim", 0) % max(base.dim(), 1)
    steps = []
    start = 0
    for i, o in enumerate(spec[2]):
        if func is aten.unbind.int:
            step_op, step_t = aten.select.int, ((ir.slot(0), dim, i), ())
        else:
            length = o[1][dim]
            step_op, step_t = aten.slice.Tensor, ((ir.slot(0), dim, start, start + length, 1), ())
            start += length
        steps.append((_step(base, step_op, step_t, o), o))
    return steps, spec


def _step(base, op, template, spec) -> ViewStep:
    return ViewStep(op, template, spec[1], spec[3], tuple(base.shape))


# -- factories ---------------------------------------------------------------------------------------

_FACTORY_META: dict = {}  # as _META


def factory(func, args, kwargs):
    """A factory op called with ``device=xshard``: ``(node, stride)``; no data transfer."""
    kwargs = dict(kwargs)
    if func is aten.arange.default or func is aten.arange.start:
        start, end = (0, args[0]) if func is aten.arange.default else args[:2]
        func, args = aten.arange.start_step, (start, end, 1)
    for k in ("device", "layout", "pin_memory", "memory_format"):
        kwargs.pop(k, None)
    if kwargs.get("dtype", 0) is None:
        del kwargs["dtype"]
    f = facts(func)
    template, rec = freeze_call(f, args, kwargs)
    key = tuple(rec.key)
    cache = _cache(_FACTORY_META)
    entry = cache.get(key)
    if entry is None:
        out = func(*args, **kwargs, device="meta")
        _check_supported(func, out)
        entry = cache[key] = (tuple(out.shape), tuple(out.stride()), out.dtype,
                              ir.intern_key(("factory", key, out.dtype)))
    shape, stride, dtype, node_key = entry
    if f.range_checked:
        check_range(func, f, args, kwargs, dtype)
    if "dtype" not in kwargs:
        # The rule needs the dtype PyTorch chose (default dtype, or inferred from the values).
        template = (template[0], template[1] + (("dtype", dtype),))
    inputs = tuple(rec.inputs)
    if f.random:
        inputs = inputs + (rng.next_key(),)
        template = (template[0], template[1] + (("_key", ir.slot(len(inputs) - 1)),))
    return ir.Node(func, inputs, template, shape, dtype, key=node_key), stride
