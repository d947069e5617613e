"""Per-op facts: what the recorder needs to know about an aten overload, computed once per overload.

``facts(func)`` is the one lookup the dispatcher makes per recorded call. It is keyed by the
overload's identity: ``OpOverload.__hash__`` is a Python method, too slow to run several times per
op.
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from xshard.core import ir
from xshard.core.decompositions import DECOMPOSITIONS, class_target
from xshard.core.lowering import RULES

aten = torch.ops.aten

# How the dispatcher handles an op (xshard.core.tensor routes on it).
SPECIAL = "special"  # its own handler (copies, transfers, reads, aliases, in-place view ops)
MUTATING = "mutating"  # writes an argument (in-place, out=, running-stat updates)
VIEW = "view"  # aliases its input
RECORD = "record"  # functional, with a lowering rule: one node
COMPOSITE = "composite"  # no rule, CompositeImplicitAutograd: run its definition
DECOMPOSE = "decompose"  # no rule, PyTorch's decomposition
FALLBACK = "fallback"  # none of the above: eager CPU

VIEW_OPS = {
    aten.view.default, aten._reshape_alias.default, aten.unsqueeze.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.select.int, aten.slice.Tensor,
    aten.diagonal.default, aten.as_strided.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.unfold.default, aten.view.dtype,
    # (and .real / .imag through them); _conj's view holds the conjugate values (no conj bit)
    aten.view_as_real.default, aten.view_as_complex.default, aten._conj.default,
    # "unsafe" only for autograd: their results alias the input all the same
    aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default,
}

SPECIAL_OPS = {
    aten.copy_.default, aten._to_copy.default, aten._local_scalar_dense.default,
    aten.detach.default, aten.alias.default, aten.lift_fresh.default,
    aten._has_compatible_shallow_copy_type.default, aten.is_pinned.default,
    aten.record_stream.default,
    # in-place view ops: the tensor itself becomes a view
    aten.squeeze_.default, aten.squeeze_.dim, aten.squeeze_.dims, aten.unsqueeze_.default,
    aten.transpose_.default, aten.t_.default, aten.swapdims_.default, aten.swapaxes_.default,
    aten.as_strided_.default,
    # in-place ops that change the tensor's sizes or storage
    aten.resize_.default, aten.resize_as_.default, aten.set_.default, aten.set_.source_Tensor,
    aten.set_.source_Tensor_storage_offset, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
}

# Results that keep their input's sharding annotation, as the input's copies or same-shaped peers
# (clone, and the zeros_like that torch.optim uses to create its state).
INHERIT_SHARDING = {aten.clone.default, aten.zeros_like.default, aten.empty_like.default,
                    aten.ones_like.default, aten.full_like.default}

# Ops whose Scalar arguments shape the program, so they stay compile-time constants.
_STATIC_SCALAR_OPS = {aten.arange, aten.linspace, aten.logspace, aten.pow, aten.float_power,
                      aten.full_like, aten.round, aten.quantile, aten.nanquantile,
                      aten.histc, aten.bucketize, aten.renorm, aten.norm, aten.linalg_vector_norm,
                      aten._foreach_norm, aten.special_zeta, aten.polygamma, aten.mvlgamma,
                      aten._cdist_forward, aten._pdist_forward, aten.cdist}

# Arguments that may be CPU tensors of any shape, as on CUDA: indices (moved to the device).
_CPU_INDEX_ARGUMENTS = {"indices"}
_CPU_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                  aten._unsafe_index, aten._unsafe_index_put}

NO_DEFAULT = object()

# Composite ops xshard defines itself (at its autograd key, e.g. the recurrent layers in
# xshard.core.rnn), by id(op): run in place of PyTorch's definition when one reaches the
# dispatcher (under torch.inference_mode, or from inside another composite).
COMPOSITES: dict = {}


# Ops whose CPU kernel converts these Scalar arguments to the result's dtype with c10's overflow
# check (``fill_(300)`` on uint8 raises in eager; the meta kernel, and XLA, wrap it to 44).
_RANGE_CHECKED = {
    aten.fill: ("value",), aten.fill_: ("value",), aten.masked_fill: ("value",),
    aten.masked_fill_: ("value",), aten.index_fill: ("value",), aten.index_fill_: ("value",),
    aten.clamp: ("min", "max"), aten.clamp_: ("min", "max"), aten.clip: ("min", "max"),
    aten.clip_: ("min", "max"), aten.clamp_min: ("min",), aten.clamp_min_: ("min",),
    aten.clamp_max: ("max",), aten.clamp_max_: ("max",), aten.where: ("self", "other"),
    aten.addcmul: ("value",), aten.addcmul_: ("value",), aten.addcdiv: ("value",),
    aten.addcdiv_: ("value",), aten.full: ("fill_value",), aten.full_like: ("fill_value",),
    aten.new_full: ("fill_value",), aten.scalar_tensor: ("s",),  # (``u8[0] = 300``)
}


# Calls whose meta kernel takes other arguments than eager CPU: a function of the call's meta
# arguments, raising where eager raises, returning those the meta kernel gives eager's result for.
def _conv_channels(args: tuple, kwargs: dict):
    """Eager's check that the input has the channels the weight expects. The meta kernel checks a
    transposed convolution's only when lowered (XLA's error at the next sync, not at the call),
    and others' with "Invalid channel dimensions"."""
    bound = dict(zip(("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
                      "output_padding", "groups"), args), **kwargs)
    x, w, transposed, groups = bound["input"], bound["weight"], bound["transposed"], bound["groups"]
    if x.dim() >= 2 and w.dim() >= 2:
        want = w.shape[0] if transposed else w.shape[1] * groups
        given = "transposed=1" if transposed else f"groups={groups}"
        torch._check(x.shape[1] == want, lambda: (
            f"Given {given}, weight of size {list(w.shape)}, expected input{list(x.shape)} to "
            f"have {want} channels, but got {x.shape[1]} channels instead"))
    return args, kwargs


META_ARGUMENTS = {
    aten.convolution.default: _conv_channels,
    aten.nll_loss_forward.default: class_target("nll_loss", 1, byte=True),
    aten.nll_loss_backward.default: class_target("nll_loss", 2, byte=True),
}


class OpFacts:
    """What the recorder needs to know about one aten overload."""

    __slots__ = ("op", "code", "route", "positional_dynamic", "kw_dynamic", "written",
                 "out_names", "random", "inplace", "functional", "inplace_twin", "rule",
                 "inherit_sharding", "decomposition", "cpu_index_positions", "cpu_index_names",
                 "name", "range_checked")

    def __init__(self, func):
        schema = func._schema
        args = schema.arguments
        self.op = func
        self.name = str(func)
        self.code = ir.op_code(func)
        static_scalars = func.overloadpacket in _STATIC_SCALAR_OPS or "upsample" in schema.name
        positional, kw = [], {}
        for a in args:
            dyn = None if static_scalars else _dynamic_kind(a)
            if not a.kwarg_only:
                positional.append(dyn)
            kw[a.name] = dyn
        self.positional_dynamic = tuple(positional)
        self.kw_dynamic = kw
        self.written = tuple(a.name for a in args
                             if a.alias_info is not None and a.alias_info.is_write)
        self.out_names = tuple(a.name for a in args if a.is_out)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.inplace = bool(self.written) and not self.out_names and schema.name.endswith("_")
        self.functional = _functional_twin(func, self) if self.written else None
        # The functional twin takes the same arguments in the same order, with the same defaults,
        # and has a rule: an in-place call can be recorded as the twin's node from one freezing
        # of its arguments.
        self.inplace_twin = (self.inplace and isinstance(self.functional, torch._ops.OpOverload)
                             and self.functional in RULES
                             and _same_arguments(func, self.functional))
        self.rule = RULES.get(func)
        checked = _RANGE_CHECKED.get(func.overloadpacket, ())
        # (position, name) of each number argument converted with an overflow check, or None
        self.range_checked = tuple(
            (i, a.name) for i, a in enumerate(args)
            if a.name in checked and str(a.type) in ("number", "Optional[number]")) or None
        self.inherit_sharding = func in INHERIT_SHARDING
        self.decomposition = DECOMPOSITIONS.get(func) or decomposition_table.get(func)
        index_op = func.overloadpacket in _CPU_INDEX_OPS
        self.cpu_index_names = _CPU_INDEX_ARGUMENTS if index_op else frozenset()
        self.cpu_index_positions = frozenset(
            i for i, a in enumerate(args) if index_op and a.name in _CPU_INDEX_ARGUMENTS)
        if func in SPECIAL_OPS:
            self.route = SPECIAL
        elif self.written:
            self.route = MUTATING
        elif func in VIEW_OPS:
            self.route = VIEW
        elif self.rule is not None:
            self.route = RECORD
        elif torch._C._dispatch_has_kernel_for_dispatch_key(func.name(),
                                                            "CompositeImplicitAutograd"):
            self.route = COMPOSITE
        elif self.decomposition is not None:
            self.route = DECOMPOSE
        else:
            self.route = FALLBACK


_FACTS: dict = {}


def facts(func) -> OpFacts:
    """The facts of aten overload ``func`` (computed on first use)."""
    f = _FACTS.get(id(func))
    if f is None:
        f = _FACTS[id(func)] = OpFacts(func)  # holds func: its id stays its own
    return f


def _dynamic_kind(arg):
    """Scalar arguments that enter the graph as inputs: (default value,) or None when static."""
    type_str = str(arg.type)
    if type_str in ("number", "Optional[number]", "float", "Optional[float]", "List[number]",
                    "List[float]"):
        return (arg.default_value if arg.has_default_value() else NO_DEFAULT,)
    if type_str in ("Tensor", "Optional[Tensor]"):
        # ``t / 0.5`` reaches us as div.Tensor(t, 0.5): the wrapped number is a scalar input too,
        # or every step of Adam's for-loop form (bias corrections) would compile anew.
        return (NO_DEFAULT,)
    return None


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


def _same_arguments(a, b) -> bool:
    def spelled(op):
        return [(x.name, str(x.type), x.kwarg_only, x.has_default_value(),
                 repr(x.default_value) if x.has_default_value() else None)
                for x in op._schema.arguments]
    return spelled(a) == spelled(b)
