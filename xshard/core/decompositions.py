"""xshard's own decompositions: ops PyTorch does not decompose (GradScaler's, the fused
optimizers'), or decomposes otherwise than its eager CPU kernel computes.

Each is a Python function of PyTorch ops over the op's arguments, run when the op reaches the
dispatcher without a lowering rule (route ``DECOMPOSE`` in ``xshard.core.ops``): the ops it calls
are recorded, so the op runs on the device instead of the CPU fallback. The in-place forms
(``_fused_adam_``) reach them through their functional twins, whose results are written back.
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

aten = torch.ops.aten


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


def class_target(op: str, position: int, byte: bool):
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


def _checked(func, check):
    """PyTorch's decomposition of ``func``, its arguments checked by ``check`` first."""
    decomposition = decomposition_table[func]

    def decompose(*args, **kwargs):
        args, kwargs = check(args, kwargs)
        return decomposition(*args, **kwargs)

    return decompose


# -- fused optimizers ----------------------------------------------------------------------------
#
# [Note: fused optimizers] ``torch.optim``'s ``fused=True`` steps call one ``_fused_<name>_`` op
# per device and dtype over lists of tensors. Their CPU kernels, the oracle, in the order they
# apply: nothing changes when ``found_inf`` is exactly 1.0 (GradScaler's skipped step); else each
# gradient is divided by ``grad_scale`` and written back so (the only change to the gradients:
# negating it for ``maximize`` is not written); then the optimizer's update, in float32 for
# 16-bit tensors; what depends on the step count alone (Adam's bias corrections) in float64, as
# the kernels do (1 - 0.999 ** step loses 1e-5 of itself in float32; TPUs emulate float64). The step counts are read, not written: ``torch.optim`` adds one before the call
# and takes ``found_inf`` off after it.

def _opmath(t) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _unscaled(grads, grad_scale):
    """The gradients divided by ``grad_scale`` (each in its own dtype), or as they are."""
    if grad_scale is None:
        return list(grads)
    scale = grad_scale.reshape(())
    return [(g.to(_opmath(g)) / scale).to(g.dtype) for g in grads]


def _unless_found_inf(found_inf, new: list, old: list) -> list:
    """``new``, or ``old`` where ``found_inf`` is 1.0 (each a list of lists of tensors)."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1.0
    return [[torch.where(skip, b, a) for a, b in zip(group_new, group_old)]
            for group_new, group_old in zip(new, old)]


def _fused_adam(adamw: bool):
    def fused_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr,
                   beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None,
                   found_inf=None):
        grads_out = _unscaled(grads, grad_scale)
        out_p, out_m, out_v, out_max = [], [], [], []
        for i, (p, g, m, v, step) in enumerate(zip(params, grads_out, exp_avgs, exp_avg_sqs,
                                                    state_steps)):
            math = _opmath(p)
            p32, g32 = p.to(math), g.to(math)
            if maximize:
                g32 = -g32
            if weight_decay != 0:
                if adamw:
                    p32 = p32 * (1 - lr * weight_decay)
                else:
                    g32 = g32 + weight_decay * p32
            m32 = m.to(math) + (1 - beta1) * (g32 - m.to(math))
            v32 = v.to(math) * beta2 + (1 - beta2) * g32 * g32
            step = step.to(torch.float64)  # the step's numbers in float64, as the kernel
            bias1 = 1 - torch.pow(beta1, step)
            bias2_sqrt = (1 - torch.pow(beta2, step)).sqrt().to(math)
            if amsgrad:
                top = torch.maximum(max_exp_avg_sqs[i].to(math), v32)
                out_max.append(top.to(max_exp_avg_sqs[i].dtype))
            else:
                top = v32
            denom = top.sqrt() / bias2_sqrt + eps
            p32 = p32 - (lr / bias1).to(math) * m32 / denom
            out_p.append(p32.to(p.dtype))
            out_m.append(m32.to(m.dtype))
            out_v.append(v32.to(v.dtype))
        if not amsgrad:
            out_max = list(max_exp_avg_sqs)
        old = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
        return tuple(_unless_found_inf(found_inf, [out_p, grads_out, out_m, out_v, out_max],
                                       old))

    fused_adam.__name__ = "_fused_adamw" if adamw else "_fused_adam"
    return fused_adam


def _fused_sgd(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
               nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    grads_out = _unscaled(grads, grad_scale)
    out_p, out_buf = [], []
    for i, (p, g) in enumerate(zip(params, grads_out)):
        math = _opmath(p)
        g32 = -g.to(math) if maximize else g.to(math)
        if weight_decay != 0:
            g32 = g32 + weight_decay * p.to(math)
        if momentum != 0:
            buf = momentum_buffer_list[i]
            if is_first_step:
                buf32 = g32
            else:
                buf32 = momentum * buf.to(math) + (1 - dampening) * g32
            out_buf.append(buf32.to(buf.dtype))
            g32 = g32 + momentum * buf32 if nesterov else buf32
        out_p.append((p.to(math) - lr * g32).to(p.dtype))
    if momentum == 0:
        out_buf = list(momentum_buffer_list)
    return tuple(_unless_found_inf(found_inf, [out_p, grads_out, out_buf],
                                   [params, grads, momentum_buffer_list]))


def _fused_adagrad(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps,
                   maximize, grad_scale=None, found_inf=None):
    grads_out = _unscaled(grads, grad_scale)
    out_p, out_sum = [], []
    for p, g, s, step in zip(params, grads_out, state_sums, state_steps):
        math = _opmath(p)
        g32 = -g.to(math) if maximize else g.to(math)
        if weight_decay != 0:
            g32 = g32 + weight_decay * p.to(math)
        clr = (lr / (1 + (step.to(torch.float64) - 1) * lr_decay)).to(math)
        s32 = s.to(math) + g32 * g32
        out_sum.append(s32.to(s.dtype))
        out_p.append((p.to(math) - clr * g32 / (s32.sqrt() + eps)).to(p.dtype))
    return tuple(_unless_found_inf(found_inf, [out_p, grads_out, out_sum],
                                   [params, grads, state_sums]))


def _fused_adagrad_with_steps(*args, **kwargs):
    """The ``float lr`` overload also returns the step counts (unchanged)."""
    return _fused_adagrad(*args, **kwargs) + (list(args[3]),)


def _weight_norm_interface_backward(grad_w, v, g, norms, dim):
    """The gradients of ``w = v * (g / norms)`` (norms of ``v`` over every dim but ``dim``), as
    ATen's CPU kernel computes them: per slice, ``s = sum(grad_w * v)``; ``grad_g = s / norm``;
    ``grad_v = (g / norm) * (grad_w - v * (s / norm**2))``; 16-bit inputs in float32. The
    forward decomposes (PyTorch's decomposition); its backward has none (it ran on the CPU
    fallback: ``nn.utils.parametrizations.weight_norm`` in training)."""
    dim = dim % v.dim() if v.dim() else 0
    others = [d for d in range(v.dim()) if d != dim]
    math = _opmath(v)
    gw, vv, gg, n = (t.to(math) for t in (grad_w, v, g, norms))
    s = (gw * vv).sum(dim=others, keepdim=True)
    grad_g = s / n
    grad_v = (gg / n) * (gw - vv * (s / (n * n)))
    return grad_v.to(v.dtype), grad_g.to(g.dtype)


def _embedding_renorm(weight, indices, max_norm: float, norm_type: float):
    """``nn.Embedding(max_norm=)``'s renormalisation, as ATen's CPU kernel does it: each row an
    index names (once, however many times it is named) whose ``norm_type``-norm exceeds
    ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``; the other rows are left as they
    are. (It ran on the CPU fallback, and refused xshard.compile.)"""
    # As eager's: the norm in the weight's dtype, the scale in float64, rounded to that dtype.
    norms = torch.linalg.vector_norm(weight.to(_opmath(weight)), norm_type, dim=-1)
    norms = norms.to(weight.dtype).to(torch.float64)
    named = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    named = named.index_fill(0, indices.reshape(-1), True)
    scale = torch.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return weight * scale.to(weight.dtype).unsqueeze(-1)


# By op: where PyTorch's decomposition differs from its eager CPU kernel, or it has none.
DECOMPOSITIONS = {
    aten.multilabel_margin_loss_forward.default: _multilabel_margin_loss_forward,
    aten.native_group_norm.default: _native_group_norm,
    # Eager takes int64 targets only (its decomposition took int32, refused uint8 in a gather).
    aten.nll_loss2d_forward.default: _checked(aten.nll_loss2d_forward.default,
                                              class_target("nll_loss2d", 1, byte=False)),
    aten.nll_loss2d_backward.default: _checked(aten.nll_loss2d_backward.default,
                                               class_target("nll_loss2d", 2, byte=False)),
    # uint8 bilinear resizing: the CPU kernel weighs in fixed point, one dim at a time, rounding
    # in between; the decomposition weighs in float32 and rounds once, half to even. The results
    # differ by 1 at many pixels (6.5 gives 6, eager 7).
    aten.upsample_bilinear2d.default: _floating_only(aten.upsample_bilinear2d.default),
    # GradScaler's two ops, which PyTorch does not decompose (they ran on the CPU fallback).
    aten._amp_foreach_non_finite_check_and_unscale.default: _amp_unscale,
    aten._amp_update_scale.default: _amp_update_scale,
    # The fused optimizers' steps (see [Note: fused optimizers]).
    aten._fused_adam.default: _fused_adam(adamw=False),
    aten._fused_adam.tensor_lr: _fused_adam(adamw=False),
    aten._fused_adamw.default: _fused_adam(adamw=True),
    aten._fused_adamw.tensor_lr: _fused_adam(adamw=True),
    aten._fused_sgd.default: _fused_sgd,
    aten._fused_sgd.tensor_lr: _fused_sgd,
    aten._fused_adagrad.default: _fused_adagrad_with_steps,
    aten._fused_adagrad.tensor_lr: _fused_adagrad,
    aten._weight_norm_interface_backward.default: _weight_norm_interface_backward,
    aten.embedding_renorm.default: _embedding_renorm,
}
