"""scaled_dot_product_attention as one fused op with its own backward.

Left alone, ``F.scaled_dot_product_attention`` on a new backend runs PyTorch's math decomposition:
dozens of recorded ops per call (mask construction, safe softmax, transposes and copies) and as many
again in backward. PyTorch lets a PrivateUse1 backend pick the "overrideable" fused kernel through
``_fused_sdp_choice``'s C++ stub, which a Python backend cannot register; xshard instead implements
``scaled_dot_product_attention`` at its autograd key with the "overrideable" fused forward and
backward ops, lowered to a few einsums, so XLA sees attention the way a hand-written JAX model
expresses it.

Dropout inside attention, grouped-query attention and nested tensors keep the math path.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_MATH = int(torch.nn.attention.SDPBackend.MATH)
_FUSED = int(torch.nn.attention.SDPBackend.OVERRIDEABLE)


def _fusable(q, k, v, attn_mask, dropout_p, enable_gqa) -> bool:
    return not (dropout_p > 0 or enable_gqa or q.dim() < 2 or k.dim() != q.dim()
                or v.dim() != q.dim() or q.shape[-1] != k.shape[-1]
                or q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]
                or not q.dtype.is_floating_point or q.dtype != k.dtype or q.dtype != v.dtype
                or (attn_mask is not None and attn_mask.dtype != torch.bool
                    and attn_mask.dtype != q.dtype))


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale):
        outs = aten._scaled_dot_product_fused_attention_overrideable(
            q, k, v, attn_mask, 0.0, is_causal, False, scale=scale)
        out, lse = outs[0], outs[1]
        ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        ctx.meta = (outs[2], outs[3], outs[4], outs[5], outs[6], outs[7], is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, attn_mask, out, lse = ctx.saved_tensors
        cum_q, cum_k, max_q, max_k, seed, offset, is_causal, scale = ctx.meta
        mask_grad = attn_mask is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = aten._scaled_dot_product_fused_attention_overrideable_backward(
            grad, q, k, v, attn_mask, [True, True, True, mask_grad], out, lse, cum_q, cum_k,
            max_q, max_k, 0.0, is_causal, seed, offset, scale=scale)
        return dq, dk, dv, (dbias if mask_grad else None), None, None


def _sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
    if not _fusable(query, key, value, attn_mask, dropout_p, enable_gqa):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # As PyTorch's own scaled_dot_product_attention does before its kernels: the math
            # kernel adds its mask to the scores, so a boolean one becomes 0 / -inf (added as
            # 1.0 / 0.0 it let every position attend everywhere, silently).
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(
                attn_mask.logical_not(), float("-inf"))
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa)[0]
    # The fused op takes (batch, heads, length, features) and a mask of 2 dims or more: fewer
    # leading dims are added (and taken off the result), a 1-D mask is read as one row.
    lead = 4 - query.dim()
    if lead > 0:
        query, key, value = (t.reshape((1,) * lead + tuple(t.shape)) for t in (query, key, value))
    if attn_mask is not None and attn_mask.dim() < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
    out = _FusedAttention.apply(query, key, value, attn_mask, is_causal, scale)
    return out.reshape(out.shape[lead:]) if lead > 0 else out


# PyTorch chooses the fused kernel for a PrivateUse1 device only through a C++ dispatch stub, so
# xshard takes over scaled_dot_product_attention at its autograd key instead.
_LIB = torch.library.Library("aten", "IMPL")
_LIB.impl("scaled_dot_product_attention", _sdpa_kernel, "AutogradPrivateUse1")
