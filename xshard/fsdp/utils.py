"""Activation checkpointing that XLA cannot undo."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from xshard.core.barrier import ordered_after
from xshard.core.tensor import XTensor

_RECOMPUTING = threading.local()
_ONE = 1.0


@contextlib.contextmanager
def _recompute_flag():
    previous = getattr(_RECOMPUTING, "on", False)
    _RECOMPUTING.on = True
    try:
        yield
    finally:
        _RECOMPUTING.on = previous


def _contexts():
    return contextlib.nullcontext(), _recompute_flag()


class _Fence(torch.autograd.Function):
    """Identity on the first ``n`` tensors, computed after the rest exist (the gradient reaching
    the module: recomputation waits for it)."""

    @staticmethod
    def forward(ctx, n, *tensors):
        ctx.n, ctx.total = n, len(tensors)
        fenced = ordered_after([t.detach() for t in tensors[:n]],
                               [t.detach() for t in tensors[n:]])
        # [Note: recomputation XLA cannot merge] XLA's CPU pipeline drops barriers before its
        # last CSE pass, which would then merge the recomputed forward with the original one (the
        # activations silently staying alive). Multiplying by a one that is a runtime input
        # (Python scalars are graph inputs) gives XLA a value it cannot prove equal to the original.
        return tuple(t * _ONE if t.is_floating_point() else t for t in fenced)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads, *([None] * (ctx.total - ctx.n)))


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recomputes ``module``'s forward in backward instead of keeping its activations.

    The recomputation starts from inputs that XLA can neither identify with the forward's (it would
    reuse the stored results) nor compute before the gradient reaching the module exists (it would
    recompute early): either way the activations would silently stay alive.

    Returns:
        ``module``, whose forward is now checkpointed.
    """
    forward = module.forward
    incoming: list = []  # gradients reaching the module's outputs, once backward gets there

    def capture(grad):
        if isinstance(grad, XTensor):
            incoming.append(grad)

    def fenced_forward(*args, **kwargs):
        if getattr(_RECOMPUTING, "on", False):
            tensors = [a for a in args if isinstance(a, XTensor)]
            if tensors:
                fenced = iter(_Fence.apply(len(tensors), *tensors, *incoming))
                incoming.clear()
                args = tuple(next(fenced) if isinstance(a, XTensor) else a for a in args)
            unit = getattr(module, "_xshard_fsdp_unit", None)
            if unit is not None:  # an FSDP unit: its parameters are gathered for the recomputation
                return unit.recompute(forward, args, kwargs)
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        incoming.clear()  # a backward that never reached this module's recomputation
        out = checkpoint(fenced_forward, *args, use_reentrant=False, context_fn=_contexts,
                         **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, XTensor) and t.requires_grad:
                t.register_hook(capture)
        return out

    module.forward = checkpointed
    module._xshard_checkpointed = True  # see [Note: FSDP gathers ordered by data]
    return module
