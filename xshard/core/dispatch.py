"""Recording aten ops: what ``XTensor.__torch_dispatch__`` and the device's factory kernels do.

Each op call becomes an IR node; nothing runs. The path of one call:

1. special ops (copies, transfers, reads, aliases) have their own handler;
2. ops that write an argument (``add_``, ``out=``, running-stat updates) are computed through their
   functional twin, and the result is written into the argument (see [Note: cells and views]);
3. functional ops with a lowering rule become a node: output shapes, strides and dtypes come from
   PyTorch's own meta kernels, cached per call signature;
4. ops without a rule run PyTorch's decomposition for them, which records simpler ops;
5. as a last resort an op runs eagerly on CPU (counted in metrics, warned once by name).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch._decomp import decomposition_table

from xshard.core import ir, lowering, metrics, rng
from xshard.core import tensor as xt
from xshard.core.tensor import XTensor, ViewStep

aten = torch.ops.aten


class DeviceMismatchError(RuntimeError):
    pass


# -- per-op facts, computed once per overload ---------------------------------------------------


class OpInfo_:
    """What the recorder needs to know about one aten overload."""

    __slots__ = ("positional_dynamic", "kw_dynamic", "written", "out_names", "random", "inplace",
                 "functional", "has_rule", "view", "composite")

    def __init__(self, func):
        schema = func._schema
        args = schema.arguments
        static_scalars = func.overloadpacket in _STATIC_SCALAR_OPS or "upsample" in schema.name
        self.positional_dynamic = []
        self.kw_dynamic = {}
        for a in args:
            dyn = None if static_scalars else _dynamic_kind(a)
            if not a.kwarg_only:
                self.positional_dynamic.append(dyn)
            self.kw_dynamic[a.name] = dyn
        self.positional_dynamic = tuple(self.positional_dynamic)
        self.written = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
        self.out_names = tuple(a.name for a in args if a.is_out)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.inplace = bool(self.written) and not self.out_names and schema.name.endswith("_")
        self.functional = _functional_twin(func, self) if self.written else None
        self.has_rule = lowering.has_rule(func)
        self.view = func in VIEW_OPS
        self.composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd")


def _dynamic_kind(arg):
    """Scalar arguments that enter the graph as inputs: (default value,) or None when static."""
    type_str = str(arg.type)
    if type_str in ("number", "Optional[number]", "float", "Optional[float]", "List[number]",
                    "List[float]"):
        return (arg.default_value if arg.has_default_value() else _NO_DEFAULT,)
    if type_str in ("Tensor", "Optional[Tensor]"):
        # ``t / 0.5`` reaches us as div.Tensor(t, 0.5): the wrapped number is a scalar input too,
        # or every step of Adam's for-loop form (bias corrections) would compile anew.
        return (_NO_DEFAULT,)
    return None


_NO_DEFAULT = object()
# Ops whose Scalar arguments shape the program, so they stay compile-time constants.
_STATIC_SCALAR_OPS = {aten.arange, aten.linspace, aten.logspace, aten.pow, aten.float_power,
                      aten.full_like, aten.round, aten.quantile, aten.nanquantile,
                      aten.histc, aten.bucketize, aten.renorm, aten.norm, aten.linalg_vector_norm,
                      aten.special_zeta, aten.polygamma, aten.mvlgamma, aten._cdist_forward,
                      aten._pdist_forward,
                      aten.cdist}


def _functional_twin(func, info):
    """The functional overload packet computing what an in-place/out/mutating op writes."""
    name = func._schema.name.split("::")[1]
    if info.inplace:
        base = name[:-1]
        special = {"normal_": "normal_functional", "bernoulli_": "bernoulli",
                   "resize_": None, "set_": None}
        base = special.get(name, base)
        if base is None:
            return None
        return _matching_overload(getattr(aten, base, None), func, ())
    if info.out_names:
        return _matching_overload(getattr(aten, name, None), func, info.out_names)
    return _matching_overload(getattr(aten, name + "_functional", None), func, ())


def _matching_overload(packet, func, skip):
    """The overload of ``packet`` taking ``func``'s arguments (less ``skip``), else the packet.

    Calling a packet makes PyTorch try its overloads one by one, and a failed try formats the
    arguments, which calls ``repr`` of xshard tensors: a device read per op.
    """
    if packet is None:
        return None
    want = [(a.name, str(a.type)) for a in func._schema.arguments if a.name not in skip]
    for name in packet.overloads():
        overload = getattr(packet, name)
        if [(a.name, str(a.type)) for a in overload._schema.arguments] == want:
            return overload
    return packet


@functools.cache
def op_info(func) -> OpInfo_:
    return OpInfo_(func)


# -- freezing arguments into a static template plus inputs --------------------------------------


class _Recording:
    """Collects a call's graph inputs while its arguments are frozen into a hashable template.

    With ``nodes=False`` only the template and the meta-kernel key are built: no input node is
    made (no view replayed, no 0-dim CPU tensor uploaded), for calls that only need the metadata.
    """

    __slots__ = ("inputs", "meta_key", "nodes")

    def __init__(self, nodes=True):
        self.inputs = []
        self.meta_key = []
        self.nodes = nodes

    def tensor(self, t):
        if type(t) is XTensor or isinstance(t, XTensor):
            node = t._value() if self.nodes else None
            self.meta_key.append((t.shape, t.stride(), t.dtype))
        else:
            node = _cpu_operand(t) if self.nodes else _check_cpu_operand(t)
            self.meta_key.append(("cpu0", t.dtype))
        self.inputs.append(node)
        return ir.Slot(len(self.inputs) - 1)

    def freeze(self, x, dynamic=None):
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, (list, tuple)):
            # The meta key is flat: it spells out nesting, and each static value's type (True == 1
            # and hash equally, yet sum(x, [0, 1]) and sum(x, [0], True) differ).
            self.meta_key.append(("seq", len(x)))
            if dynamic is not None and x and all(type(v) in _SCALAR_TYPES for v in x):
                return tuple(self.freeze(v, dynamic) for v in x)
            return tuple(self.freeze(v) for v in x)
        if dynamic is not None and type(x) in _SCALAR_TYPES:
            default = dynamic[0]
            if default is _NO_DEFAULT or x != default or type(x) is not type(default):
                self.inputs.append(ir.scalar_node(x) if self.nodes else None)
                self.meta_key.append(type(x))
                return ir.Slot(len(self.inputs) - 1)
        if isinstance(x, torch.Generator):
            raise TypeError(
                "xshard random ops draw from the device's own stream; pass generator=None and seed "
                "it with torch.manual_seed(seed).")
        self.meta_key.append((type(x), x))
        return x


_SCALAR_TYPES = (bool, int, float, complex)


def _cpu_operand(t: torch.Tensor) -> ir.Node:
    """A CPU tensor passed to a device op: allowed when 0-dim (uploaded as an input), as with CUDA."""
    from xshard.core import graph

    _check_cpu_operand(t)
    return graph.upload_node(t)


def _check_cpu_operand(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and t.dim() == 0:
        return None
    raise DeviceMismatchError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{xt.DEVICE} and {t.device} (a tensor of shape {tuple(t.shape)}). Move it with "
        f"t.to(xshard.device()) first; only 0-dim CPU tensors may be mixed with device tensors.")


def _freeze_call(func, info, args, kwargs, nodes=True):
    rec = _Recording(nodes)
    dyn = info.positional_dynamic
    targs = tuple(rec.freeze(a, dyn[i] if i < len(dyn) else None) for i, a in enumerate(args))
    tkwargs = []
    for k, v in kwargs.items():
        if k == "generator" and v is None:
            continue
        rec.meta_key.append(k)
        tkwargs.append((k, rec.freeze(v, info.kw_dynamic.get(k))))
    return (targs, tuple(tkwargs)), rec


# -- meta inference -----------------------------------------------------------------------------


_META_CACHE: dict = {}


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        if isinstance(x, XTensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return torch.empty((), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == xt.DEVICE_TYPE:
        return torch.device("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _meta_outputs(func, args, kwargs, key):
    """(shape, stride, dtype) per output as PyTorch computes them, or a non-tensor structure."""
    cached = _META_CACHE.get(key)
    if cached is not None:
        return cached
    margs = _to_meta(args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    out = func(*margs, **mkwargs)
    spec = _describe(out)
    _META_CACHE[key] = spec
    return spec


def _describe(out):
    if isinstance(out, torch.Tensor):
        return ("t", tuple(out.shape), tuple(out.stride()), out.dtype, out.storage_offset())
    if isinstance(out, (list, tuple)):
        return ("seq", type(out), tuple(_describe(o) for o in out))
    return ("const", out)


# -- the dispatcher -------------------------------------------------------------------------------


def dispatch(func, args, kwargs):
    handler = _SPECIAL.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    info = op_info(func)
    if info.written:
        return _mutating(func, info, args, kwargs)
    if info.view:
        return _view(func, info, args, kwargs)
    if info.has_rule:
        return record(func, info, args, kwargs)
    if info.composite:
        # Composite ops reach us when called from inside a decomposition; run their definition.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    decomposition = decomposition_table.get(func)
    if decomposition is not None:
        out = decomposition(*args, **kwargs)
        if out is not NotImplemented:
            return out
    return cpu_fallback(func, args, kwargs)


def record(func, info, args, kwargs):
    """Records a functional op with a lowering rule as a node and returns its result tensors."""
    template, rec = _freeze_call(func, info, args, kwargs)
    try:
        spec = _meta_outputs(func, args, kwargs, (func, tuple(rec.meta_key)))
    except (NotImplementedError, torch._subclasses.fake_tensor.DataDependentOutputException):
        return cpu_fallback(func, args, kwargs)
    inputs = rec.inputs
    if info.random:
        inputs.append(rng.next_key())
        template = (template[0], template[1] + (("_key", ir.Slot(len(inputs) - 1)),))
    out = _wrap_outputs(func, tuple(inputs), template, spec)
    if func in _INHERIT_SHARDING:
        _inherit_sharding(args, out)
    return out


# Results that keep their input's sharding annotation, as the input's copies or same-shaped peers
# (clone, and the zeros_like that torch.optim uses to create its state).
_INHERIT_SHARDING = {aten.clone.default, aten.zeros_like.default, aten.empty_like.default,
                     aten.ones_like.default, aten.full_like.default}


def _inherit_sharding(args, out):
    if isinstance(args[0], XTensor) and isinstance(out, XTensor):
        source = args[0]
        if source._cell.sharding is not None and not source._chain:
            out._cell.sharding = source._cell.sharding
    return out


def _wrap_outputs(func, inputs, template, spec):
    if spec[0] == "t":
        _, shape, stride, dtype, _ = spec
        return xt.new_base(ir.Node(func, inputs, template, shape, dtype), stride)
    if spec[0] == "seq":
        outs = spec[2]
        metas = tuple((o[1], o[3]) if o[0] == "t" else None for o in outs)
        multi = ir.Node(func, inputs, template, outputs=metas)
        results = [xt.new_base(ir.output_node(multi, i), o[2]) if o[0] == "t" else o[1]
                   for i, o in enumerate(outs)]
        return spec[1](results)
    return spec[1]


def _mutating(func, info, args, kwargs):
    """In-place, out= and other mutating ops: compute through the functional twin, then write."""
    functional = info.functional
    if functional is None:
        return cpu_fallback(func, args, kwargs)
    bound = _bind(func, args, kwargs)
    # Let PyTorch's meta kernel validate the call (broadcast into self, dtype cast rules, overlap).
    _, rec = _freeze_call(func, info, args, kwargs, nodes=False)
    try:
        _meta_outputs(func, args, kwargs, (func, tuple(rec.meta_key)))
    except NotImplementedError:
        pass
    if info.out_names:
        fargs = {k: v for k, v in bound.items() if k not in info.out_names}
        if not any(isinstance(v, torch.Tensor) for v in fargs.values()):
            # A factory's out= form (e.g. arange into an empty device tensor): make it here.
            first_out = bound[info.out_names[0]]
            fargs.setdefault("dtype", first_out.dtype)
            fargs["device"] = first_out.device
        result = functional(**fargs)
        results = result if isinstance(result, (tuple, list)) else (result,)
        outs = [bound[name] for name in info.out_names]
        for dst, src in zip(outs, results):
            _write(dst, src)
        return outs[0] if len(outs) == 1 else tuple(outs)
    if info.inplace:
        if _first_argument(functional) != "self":  # polygamma_(self, n) vs polygamma(n, self)
            result = functional(**_bind(func, args, kwargs))
        else:
            # Defaults made explicit pick the matching overload: bernoulli_(p=0.5) -> bernoulli.p.
            result = functional(*_with_defaults(func, args), **kwargs)
        target = args[0]
        if isinstance(target, (list, tuple)):
            for dst, src in zip(target, result):
                _write(dst, src)
            return None
        _write(target, result)
        return target
    # A functional twin returns the op's own outputs followed by the new value of each written arg.
    result = functional(**{k: v for k, v in bound.items()})
    n_written = len(info.written)
    for name, new in zip(info.written, result[len(result) - n_written:]):
        _write(bound[name], new)
    own = result[: len(result) - n_written]
    return own[0] if len(own) == 1 else tuple(own)


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


def _write(dst, src):
    """Writes tensor ``src`` into ``dst`` as an in-place op would (cast to dst's dtype)."""
    if not isinstance(dst, XTensor):
        raise DeviceMismatchError(
            f"Cannot write an xshard result into a {dst.device} tensor in place; move it with "
            f".to(xshard.device()) first.")
    value = src._value() if isinstance(src, XTensor) else _cpu_operand(src)
    if tuple(value.shape) != tuple(dst.shape):
        if tuple(dst.shape) != tuple(torch.broadcast_shapes(value.shape, dst.shape)):
            raise RuntimeError(
                f"xshard cannot resize an out= tensor of shape {tuple(dst.shape)} to "
                f"{tuple(value.shape)}; pass an out tensor of the result's shape, or use the "
                f"functional form.")
        value = expand(value, dst.shape)
    if value.dtype != dst.dtype:
        value = convert(value, dst.dtype)
    dst._assign(value)


def expand(value: ir.Node, shape) -> ir.Node:
    shape = tuple(shape)
    return ir.Node(aten.expand.default, (value,), ((ir.Slot(0), shape), ()), shape, value.dtype)


def convert(value: ir.Node, dtype) -> ir.Node:
    return ir.Node(aten._to_copy.default, (value,), ((ir.Slot(0),), (("dtype", dtype),)),
                   value.shape, dtype)


# -- views -----------------------------------------------------------------------------------------

VIEW_OPS = {
    aten.view.default, aten._reshape_alias.default, aten.unsqueeze.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.select.int, aten.slice.Tensor,
    aten.diagonal.default, aten.as_strided.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.unfold.default, aten.view.dtype,
}


def _view(func, info, args, kwargs):
    base = args[0]
    template, rec = _freeze_call(func, info, args, kwargs, nodes=False)
    spec = _meta_outputs(func, args, kwargs, (func, tuple(rec.meta_key)))
    if len(rec.inputs) != 1:  # a view op with a tensor-valued static argument: not aliasing-safe
        template, rec = _freeze_call(func, info, args, kwargs)
        return _wrap_outputs(func, tuple(rec.inputs), template, spec)
    if spec[0] == "t":
        return _make_view(base, func, template, spec)
    # split / split_with_sizes / unbind: each output is a slice or select of the base.
    dim = _split_dim(func, args, kwargs, base.dim())
    outs = []
    start = 0
    for i, o in enumerate(spec[2]):
        if func is aten.unbind.int:
            step_op, step_t = aten.select.int, ((ir.Slot(0), dim, i), ())
        else:
            length = o[1][dim]
            step_op, step_t = aten.slice.Tensor, ((ir.Slot(0), dim, start, start + length, 1), ())
            start += length
        outs.append(_make_view(base, step_op, step_t, o))
    return spec[1](outs)


def _split_dim(func, args, kwargs, ndim):
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    dim = bound.get("dim", 0)
    return dim % max(ndim, 1)


def _make_view(base: XTensor, op, template, spec) -> XTensor:
    _, shape, stride, dtype, offset = spec
    if op is not aten.as_strided.default:
        # The meta kernel saw the parent at offset 0; as_strided's offset is absolute already.
        offset += base.storage_offset()
    step = ViewStep(op, template, shape, dtype, tuple(base.shape))
    return XTensor(base._cell, base._chain + (step,), shape, stride, dtype, storage_offset=offset)


def _alias(func, args, kwargs):
    t = args[0]
    return XTensor(t._cell, t._chain, t.shape, t.stride(), t.dtype,
                   storage_offset=t.storage_offset())


# -- transfers, copies and reads --------------------------------------------------------------------


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, XTensor):
        annotation = dst._cell.sharding
        if annotation is not None and not isinstance(src, XTensor) and not dst._chain and \
                tuple(src.shape) == tuple(dst.shape) and src.dtype == dst.dtype:
            # Host data into an annotated tensor (loading a checkpoint into sharded parameters):
            # straight into its shards, never a replicated copy on every device.
            dst._assign(_upload_annotated(src, annotation))
            return dst
        value = src._value() if isinstance(src, XTensor) else _upload_any(src)
        if tuple(value.shape) != tuple(dst.shape):
            torch.broadcast_shapes(value.shape, dst.shape)  # raises PyTorch's own error
            value = expand(value, dst.shape)
        if value.dtype != dst.dtype:
            value = convert(value, dst.dtype)
        dst._assign(value)
        return dst
    from xshard.core import graph

    dst.copy_(graph.to_cpu(src))
    return dst


def copy_from(src, dst, non_blocking=False):
    """Kernel of ``aten::_copy_from`` for the xshard device.

    ``copy_`` reaches it when the Python dispatch key is excluded, e.g. inside
    ``torch.tensor(data, device=xshard.device())``, which copies the host data into an empty
    device tensor.
    """
    return _copy_(aten.copy_.default, (dst, src), {})


def _upload_annotated(t: torch.Tensor, annotation) -> ir.Node:
    """CPU tensor ``t`` uploaded as ``annotation`` lays it out (padded where a dim doesn't divide)."""
    from xshard.core import graph

    logical = tuple(t.shape)
    padded = tuple(annotation.padded_shape(logical))
    if padded != logical:
        full = t.new_zeros(padded)
        full[tuple(slice(0, n) for n in logical)] = t
        t = full
    node = graph.upload_node(t.contiguous(), annotation.jax_sharding)
    return ir.data_node(node.payload, logical, node.dtype, node.sharding)


def _upload_any(t: torch.Tensor) -> ir.Node:
    from xshard.core import graph

    return graph.upload_node(t)


def _to_copy(func, args, kwargs):
    src = args[0]
    device = kwargs.get("device")
    dtype = kwargs.get("dtype") or src.dtype
    if device is not None and torch.device(device).type != xt.DEVICE_TYPE:
        from xshard.core import graph

        out = graph.to_cpu(src).to(device=device, dtype=dtype)
        if kwargs.get("memory_format") not in (None, torch.preserve_format):
            out = out.contiguous(memory_format=kwargs["memory_format"])
        return out
    value = src._value()
    if dtype != value.dtype:
        value = convert(value, dtype)
    else:
        value = ir.Node(aten.clone.default, (value,), ((ir.Slot(0),), ()), value.shape,
                        value.dtype)
    memory_format = kwargs.get("memory_format")
    stride = None
    if memory_format in (None, torch.preserve_format) and src.is_contiguous():
        stride = src.stride()
    elif memory_format is not None and memory_format is not torch.preserve_format:
        stride = torch.empty(src.shape, device="meta").contiguous(
            memory_format=memory_format).stride()
    out = xt.new_base(value, stride)
    if not src._chain and src._cell.sharding is not None:
        out._cell.sharding = src._cell.sharding
    return out


def _local_scalar_dense(func, args, kwargs):
    from xshard.core import graph

    return graph.to_cpu(args[0]).item()


def _no_op(func, args, kwargs):
    return args[0]


def _restride_(func, args, kwargs):
    """In-place view ops (``squeeze_``, ``t_``, ``as_strided_``...) change the tensor's own shape.

    The tensor becomes the view its functional twin makes (same cell, one more view step), and its
    sizes and strides are set to the view's, as the CPU kernel does.
    """
    self = args[0]
    view = getattr(op_info(func).functional, func._overloadname, None) or op_info(func).functional
    out = view(*args, **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        aten.as_strided_.default(self, out.shape, out.stride(), out.storage_offset())
    self._cell, self._chain, self._cache_version = out._cell, out._chain, -1
    return self


_SPECIAL = {
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.lift_fresh.default: _alias,
    aten._has_compatible_shallow_copy_type.default: lambda f, a, k: True,
    aten.is_pinned.default: lambda f, a, k: False,
    aten.record_stream.default: lambda f, a, k: None,
}
for _op in (aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default,
            aten.transpose_.default, aten.t_.default, aten.swapdims_.default,
            aten.swapaxes_.default, aten.as_strided_.default):
    _SPECIAL[_op] = _restride_


# -- factories on the device -------------------------------------------------------------------


def factory(func, args, kwargs):
    """Kernel for factory ops called with ``device=xshard``: a node, no data transfer."""
    kwargs = dict(kwargs)
    if func is aten.arange.default or func is aten.arange.start:
        start, end = (0, args[0]) if func is aten.arange.default else args[:2]
        func, args = aten.arange.start_step, (start, end, 1)
    for k in ("device", "layout", "pin_memory"):
        kwargs.pop(k, None)
    meta = func(*args, **kwargs, device="meta")
    if func not in _FACTORY_KEEP_MEMORY_FORMAT:
        kwargs.pop("memory_format", None)
    kwargs["dtype"] = meta.dtype
    info = op_info(func)
    template, rec = _freeze_call(func, info, args, kwargs)
    inputs = rec.inputs
    if info.random:
        inputs.append(rng.next_key())
        template = (template[0], template[1] + (("_key", ir.Slot(len(inputs) - 1)),))
    node = ir.Node(func, tuple(inputs), template, tuple(meta.shape), meta.dtype)
    return xt.new_base(node, tuple(meta.stride()))


_FACTORY_KEEP_MEMORY_FORMAT: set = set()

FACTORIES = (
    "empty.memory_format", "empty_strided", "full", "zeros", "ones", "arange.start_step",
    "arange", "arange.start",
    "eye", "eye.m", "linspace", "logspace", "rand", "randn", "randint", "randint.low",
    "randperm", "scalar_tensor", "empty_like", "tril_indices", "triu_indices",
)


# -- the last resort ----------------------------------------------------------------------------


_WARNED: set = set()


def cpu_fallback(func, args, kwargs):
    """Runs ``func`` eagerly on CPU copies of the inputs and moves the results back."""
    from xshard.core import graph

    metrics.count_fallback(str(func))
    if func not in _WARNED:
        _WARNED.add(func)
        warnings.warn(
            f"xshard has no lowering for {func}; it runs eagerly on CPU (slow: the inputs are "
            f"computed and copied to the host). Counted in xshard.metrics.snapshot()"
            f"['cpu_fallbacks'].", stacklevel=3)
    moved = {}

    def to_host(x):
        if isinstance(x, XTensor):
            cpu = graph.to_cpu(x)
            moved[id(cpu)] = x
            return cpu
        if isinstance(x, torch.device) and x.type == xt.DEVICE_TYPE:
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(to_host(v) for v in x)
        return x

    cargs = to_host(args)
    ckwargs = {k: to_host(v) for k, v in kwargs.items()}
    out = func(*cargs, **ckwargs)
    info = op_info(func)
    if info.written:
        bound_cpu = _bind(func, cargs, ckwargs)
        bound_dev = _bind(func, args, kwargs)
        for name in info.written:
            cpu_vals, dev_vals = bound_cpu[name], bound_dev[name]
            pairs = zip(cpu_vals, dev_vals) if isinstance(cpu_vals, (list, tuple)) else [
                (cpu_vals, dev_vals)]
            for c, d in pairs:
                if isinstance(d, XTensor):
                    d._assign(graph.upload_node(c))

    def to_dev(x):
        if isinstance(x, torch.Tensor):
            if id(x) in moved:
                return moved[id(x)]
            return xt.new_base(graph.upload_node(x), x.stride() if x.is_contiguous() else None)
        if isinstance(x, (list, tuple)):
            return type(x)(to_dev(v) for v in x)
        return x

    return to_dev(out)


xt._dispatch = dispatch
