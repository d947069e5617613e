"""Foreach ops (lists of tensors, as torch.optim's default implementations use)."""

from __future__ import annotations

import torch

from xshard.core.lowering.elementwise import (
    _UNARY_FLOAT, _add, _addcdiv, _addcmul, _clamp, _copy, _div, _lerp, _pow, _sub, _unary_float,
    _zero)
from xshard.core.lowering.reductions import _maximum, _vector_norm
from xshard.core.lowering.table import RULES, rule

aten = torch.ops.aten


def _foreach(fn, n_lists):
    def lower(*args, **kwargs):
        lists = args[:n_lists]
        rest = args[n_lists:]
        out = []
        for i, items in enumerate(zip(*lists)):
            extra = tuple(r[i] if isinstance(r, (list, tuple)) else r for r in rest)
            kw = {k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}
            out.append(fn(*items, *extra, **kw))
        return out
    return lower


_FOREACH_UNARY = {
    "sqrt": _UNARY_FLOAT[aten.sqrt], "exp": _UNARY_FLOAT[aten.exp],
    "log": _UNARY_FLOAT[aten.log], "reciprocal": _UNARY_FLOAT[aten.reciprocal],
    "sigmoid": _UNARY_FLOAT[aten.sigmoid], "tanh": _UNARY_FLOAT[aten.tanh],
    "sin": _UNARY_FLOAT[aten.sin], "cos": _UNARY_FLOAT[aten.cos],
    "expm1": _UNARY_FLOAT[aten.expm1], "log1p": _UNARY_FLOAT[aten.log1p],
    "rsqrt": _UNARY_FLOAT[aten.rsqrt],
}
for _name, _fn in _FOREACH_UNARY.items():
    rule(getattr(aten, f"_foreach_{_name}").default)(_foreach(_unary_float(_fn), 1))
for _name in ("neg", "abs", "sign"):  # as the single-tensor op (sign of NaN: 0, as ATen)
    rule(getattr(aten, f"_foreach_{_name}").default)(
        _foreach(RULES[getattr(aten, _name).default], 1))
rule(aten._foreach_zero.default)(_foreach(_zero, 1))

for _name, _fn in {"add": _add, "sub": _sub, "mul": RULES[aten.mul.Tensor],
                   "div": _div, "maximum": _maximum,
                   "minimum": RULES[aten.minimum.default], "pow": _pow,
                   "clamp_min": lambda x, m: _clamp(x, min=m),
                   "clamp_max": lambda x, m: _clamp(x, max=m)}.items():
    packet = getattr(aten, f"_foreach_{_name}")
    for _ov in packet.overloads():
        if _ov.endswith("out"):
            continue
        n_lists = 2 if _ov == "List" else 1
        rule(getattr(packet, _ov))(_foreach(_fn, n_lists))

rule(aten._foreach_lerp.List)(_foreach(_lerp, 3))
rule(aten._foreach_lerp.Scalar)(_foreach(_lerp, 2))
rule(aten._foreach_lerp.ScalarList)(_foreach(_lerp, 2))
for _ov in ("Scalar", "ScalarList", "Tensor"):
    rule(getattr(aten._foreach_addcmul, _ov))(_foreach(_addcmul, 3))
    rule(getattr(aten._foreach_addcdiv, _ov))(_foreach(_addcdiv, 3))
rule(aten._foreach_copy.default)(_foreach(_copy, 2))


# ``_foreach_pow.ScalarAndTensor(scalar, exponents)`` raises one scalar to each tensor of a list
# (the capturable Adam family computes its bias corrections ``beta ** step`` so): its first argument
# is not the list, unlike the overloads registered above.
@rule(aten._foreach_pow.ScalarAndTensor)
def _foreach_scalar_pow(base, exponents):
    return [_pow(base, e) for e in exponents]


@rule(aten._foreach_norm.Scalar)
def _foreach_norm(tensors, ord=2, dtype=None):
    return [_vector_norm(t, ord, None, False, dtype) for t in tensors]
