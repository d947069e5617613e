"""Activation checkpointing that XLA cannot undo."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from xshard.core.barrier import optimization_barrier
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
    """Identity whose forward puts the inputs behind an optimisation barrier."""

    @staticmethod
    def forward(ctx, *tensors):
        fenced = optimization_barrier([t.detach() for t in tensors])
        # [Note: recomputation XLA cannot merge] XLA's CPU pipeline drops barriers before its
        # last CSE pass, which then merges the recomputed forward with the original one (the
        # activations silently stay alive). Multiplying by a one that is a runtime input (Python
        # scalars are graph inputs) gives XLA a value it cannot prove equal to the original.
        return tuple(t * _ONE if t.is_floating_point() else t for t in fenced)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recomputes ``module``'s forward in backward instead of keeping its activations.

    The recomputation starts from inputs passed through an optimisation barrier: without it XLA
    would see the recomputed ops as duplicates of the forward ones and reuse the stored results,
    silently keeping the activations alive.

    Returns:
        ``module``, whose forward is now checkpointed.
    """
    forward = module.forward

    def fenced_forward(*args, **kwargs):
        if getattr(_RECOMPUTING, "on", False):
            tensors = [a for a in args if isinstance(a, XTensor)]
            if tensors:
                fenced = iter(_Fence.apply(*tensors))
                args = tuple(next(fenced) if isinstance(a, XTensor) else a for a in args)
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(fenced_forward, *args, use_reentrant=False, context_fn=_contexts,
                          **kwargs)

    module.forward = checkpointed
    return module
