"""Per-op facts: what the recorder needs to know about an aten overload, computed once per overload.

``facts(func)`` is the one lookup the dispatcher makes per recorded call. It is keyed by the
overload's identity: ``OpOverload.__hash__`` is a Python method, too slow to run several times per
op.
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from xshard.core import ir
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


def _floating_only(func):
    """PyTorch's decomposition of ``func`` for floating-point inputs; integer inputs run eagerly
    (``NotImplemented`` sends them to the CPU fallback)."""
    decomposition = decomposition_table[func]

    def decompose(x, *args, **kwargs):
        if not x.dtype.is_floating_point:
            return NotImplemented
        return decomposition(x, *args, **kwargs)

    return decompose


def _multilabel_margin_loss_forward(x, target, reduction):
    """Per sample, the mean over classes c of the sum over its labels j (those before the first
    -1) of ``max(0, 1 - (x[j] - x[c]))``, c not a label; and which classes are labels. PyTorch's
    decomposition also counted the slots after the -1, as labels of class 0 (x = [.1, .2, .4, .8],
    labels [3, 0, -1, 1]: 2.05 where eager gives 0.85)."""
    torch._check(x.dim() <= 2 and (x.dim() == 0 or x.shape[-1] != 0), lambda: (
        f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: "
        f"{tuple(x.shape)}"))
    torch._check(target.shape == x.shape, lambda: (
        f"inconsistent target size: {tuple(target.shape)} for input of size: {tuple(x.shape)}"))
    rows, labels = torch.atleast_2d(x), torch.atleast_2d(target)
    n = rows.shape[-1]
    slot = torch.arange(n, device=labels.device)
    end = torch.where(labels == -1, slot, n).amin(dim=-1, keepdim=True)
    listed = slot < end  # (N, slot): the slot holds a label
    is_label = (torch.where(listed, labels, -1).unsqueeze(-1) == slot).any(dim=1)  # (N, class)
    picked = rows.gather(-1, torch.where(listed, labels, 0))  # x at each slot's label
    margins = (1 - picked.unsqueeze(-1) + rows.unsqueeze(-2)).clamp_min(0) / n
    counted = listed.unsqueeze(-1) & ~is_label.unsqueeze(-2)  # (N, slot, class)
    loss = torch.where(counted, margins, 0).sum(dim=(-2, -1))
    if reduction == 1:
        loss = loss.mean()
    elif reduction == 2:
        loss = loss.sum()
    else:
        loss = loss.reshape(x.shape[:-1])
    return loss, is_label.to(x.dtype).reshape(target.shape)


def _native_group_norm(x, weight, bias, N, C, HxW, group, eps):
    """A 16-bit input with float32 weights (the mixed dtypes eager CPU accepts) is normalized in
    float32, and its mean and 1/std are float32, as in eager. PyTorch's decomposition rounded them
    to the input's dtype: the weight's gradient, computed from them, was 3.6e-2 from float64 where
    eager's is 1.1e-6 (bfloat16)."""
    mixed = x.dtype in (torch.float16, torch.bfloat16) and (weight is not None or bias is not None) \
        and all(t is None or t.dtype == torch.float32 for t in (weight, bias))
    out, mean, rstd = _GROUP_NORM(x.float() if mixed else x, weight, bias, N, C, HxW, group, eps)
    return (out.to(x.dtype) if mixed else out), mean, rstd


_GROUP_NORM = decomposition_table[aten.native_group_norm.default]


def _one_float_element(t, name: str, dtype=torch.float32) -> None:
    torch._check(t.numel() == 1, lambda: f"{name} must be a 1-element tensor.")
    torch._check(t.dtype == dtype, lambda: (
        f"{name} must be {'a float' if dtype == torch.float32 else 'an int'} tensor."))


def _amp_unscale(grads, found_inf, inv_scale):
    """GradScaler's unscale (the functional form of ``_amp_foreach_non_finite_check_and_unscale_``,
    which PyTorch gives no decomposition): each gradient times ``inv_scale``, computed in float32
    for 16-bit gradients as ATen's kernel does, and ``found_inf`` set to 1 when any gradient holds
    an inf or a NaN (else kept). On the device, it needs no read of the gradients to the host."""
    _one_float_element(inv_scale, "inv_scale")
    _one_float_element(found_inf, "found_inf")
    if not grads:
        return [], found_inf.clone()
    scale = inv_scale.reshape(())
    out, finite = [], []
    for g in grads:
        if g.dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
            raise NotImplementedError(  # as eager
                f"\"_amp_foreach_non_finite_check_and_unscale_\" not implemented for a gradient "
                f"of dtype {g.dtype}: gradients to unscale must be floating point")
        wide = g.dtype in (torch.float16, torch.bfloat16)
        out.append((g.float() * scale).to(g.dtype) if wide else g * scale.to(g.dtype))
        finite.append(g.isfinite().all())
    found = torch.stack(finite).all().logical_not()
    return out, torch.where(found, 1.0, found_inf)


def _amp_update_scale(scale, growth_tracker, found_inf, growth_factor: float,
                      backoff_factor: float, growth_interval: int):
    """GradScaler's scale update (the functional form of ``_amp_update_scale_``): after an
    overflow (``found_inf`` nonzero) the scale times ``backoff_factor`` and the count of good steps
    reset; after ``growth_interval`` good steps in a row the scale times ``growth_factor`` (kept if
    that overflows) and the count reset; else the count plus one. The products are rounded from
    float64 to float32, as ATen's CPU kernel (float times double) does."""
    _one_float_element(growth_tracker, "growth_tracker", torch.int32)
    _one_float_element(scale, "current_scale")
    _one_float_element(found_inf, "found_inf")
    found = found_inf.reshape(()) != 0
    successful = growth_tracker + 1
    grow = (successful == growth_interval).reshape(())
    grown = (scale.double() * growth_factor).float()
    backed_off = (scale.double() * backoff_factor).float()
    new_scale = torch.where(found, backed_off,
                            torch.where(grow & grown.isfinite(), grown, scale))
    new_tracker = torch.where(found | grow, torch.zeros_like(successful), successful)
    return new_scale, new_tracker


def _class_target(op: str, position: int, byte: bool):
    """Checks the class target of ``op`` (argument ``position``) as eager CPU does: int64, or
    uint8 where ``byte`` (nll_loss of 1-D and 2-D input). Returns the arguments with a uint8
    target as int64, for a meta kernel (whose gather refuses uint8, and took int32)."""
    allowed = (torch.int64, torch.uint8) if byte else (torch.int64,)

    def check(args: tuple, kwargs: dict):
        in_args = len(args) > position
        target = args[position] if in_args else kwargs["target"]
        if target.dtype not in allowed:
            names = " or ".join(str(d) for d in allowed)
            raise RuntimeError(f"{op}: expected the target's dtype to be {names}, but got "
                               f"{target.dtype}; convert it: target.long()")
        if target.dtype == torch.int64:
            return args, kwargs
        target = target.long()
        if in_args:
            return args[:position] + (target,) + args[position + 1:], kwargs
        return args, {**kwargs, "target": target}

    return check


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
META_ARGUMENTS = {
    aten.nll_loss_forward.default: _class_target("nll_loss", 1, byte=True),
    aten.nll_loss_backward.default: _class_target("nll_loss", 2, byte=True),
}


def _checked(func, check):
    """PyTorch's decomposition of ``func``, its arguments checked by ``check`` first."""
    decomposition = decomposition_table[func]

    def decompose(*args, **kwargs):
        args, kwargs = check(args, kwargs)
        return decomposition(*args, **kwargs)

    return decompose


# Where PyTorch's decomposition differs from its eager CPU kernel, by op.
DECOMPOSITIONS = {
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.native_group_norm.default: _native_group_norm,
    # Eager takes int64 targets only (its decomposition took int32, refused uint8 in a gather).
    aten.nll_loss2d_forward.default: _checked(aten.nll_loss2d_forward.default,
                                              _class_target("nll_loss2d", 1, byte=False)),
    aten.nll_loss2d_backward.default: _checked(aten.nll_loss2d_backward.default,
                                               _class_target("nll_loss2d", 2, byte=False)),
    # uint8 bilinear resizing: the CPU kernel weighs in fixed point, one dim at a time, rounding
    # in between; the decomposition weighs in float32 and rounds once, half to even. The results
    # differ by 1 at many pixels (6.5 gives 6, eager 7).
    aten.upsample_bilinear2d.default: _floating_only(aten.upsample_bilinear2d.default),
    # GradScaler's two ops, which PyTorch does not decompose (they ran on the CPU fallback).
    aten._amp_foreach_non_finite_check_and_unscale.default: _amp_unscale,
    aten._amp_update_scale.default: _amp_update_scale,
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
