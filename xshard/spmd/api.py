"""Annotating tensors with shardings: mark_sharding, clear_sharding and what reads them back.

A mark on device data reshards the data now; a mark on a pending value becomes a sharding constraint
in the graph. Either way the annotation is stored on the tensor's storage (its cell), so it survives
sync, in-place ops, clone and deepcopy, and every later result of a sync for that tensor is laid out
as annotated.
"""

from __future__ import annotations

import torch

from xshard.core import api as core
from xshard.core import ir
from xshard.core.tensor import XTensor
from xshard.mesh import Mesh
from xshard.spmd import sharding as sh
from xshard.spmd.sharded_tensor import (XLAShardedTensor, annotation_of,  # noqa: F401
                                        device_tensor, get_sharding_spec, get_sharding_type,
                                        wrap_if_sharded)
from xshard.spmd.spec import ShardingType


class ShardingAnnotationError(RuntimeError):
    pass


def _base_only(t: XTensor, what: str) -> None:
    if core.is_view(t):
        raise ValueError(
            f"{what} annotates a tensor's whole storage, but this tensor (shape {tuple(t.shape)}) "
            f"is a view of another tensor. Annotate the base tensor, or a copy: "
            f"{what}(t.clone(), ...).")


def reshard_data(node: ir.Node, annotation: sh.Annotation) -> ir.Node:
    """Device data laid out as ``annotation`` says (padded at the end where dims don't divide),
    from any devices onto the annotation's mesh, whatever its devices and their order."""
    return core.relayout(node, annotation.jax_sharding, annotation.padded_shape(node.shape))


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec) -> XLAShardedTensor:
    """Annotates ``t`` in place with how it is split over ``mesh``.

    Args:
        t: a tensor on ``xshard.device()`` (or an ``XLAShardedTensor``).
        mesh: the device mesh.
        partition_spec: one entry per dimension of ``t``: a mesh axis name or index, a tuple of
            them (several mesh axes on one dimension, major first), or None (replicated). Mesh axes
            not named replicate the tensor.

    Returns:
        An ``XLAShardedTensor`` for ``t`` (``t`` itself carries the annotation too).

    Raises:
        ValueError: the spec does not fit the tensor or the mesh.
        RuntimeError: ``t`` already has a different non-replicated annotation (clear it first).

    Example:
        >>> mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
        >>> xs.mark_sharding(model.fc1.weight, mesh, ("model", None))  # doctest: +SKIP
    """
    t = device_tensor(t, "mark_sharding")
    _base_only(t, "mark_sharding")
    annotation = sh.annotation(mesh, partition_spec, t.dim())
    annotate(t, annotation)
    return XLAShardedTensor.wrap(t)


def annotate(t: XTensor, annotation: sh.Annotation) -> None:
    """Annotates base tensor ``t`` (see ``mark_sharding``): data is resharded now, a pending
    value gets a sharding constraint, and a parameter's gradients will be laid out alike."""
    current = core.annotation(t)
    if current is not None:
        if current == annotation:
            return
        if current.sharding_type != ShardingType.REPLICATED:
            raise ShardingAnnotationError(
                f"This tensor is already annotated {current.hlo_sharding}; the new annotation "
                f"{annotation.hlo_sharding} differs. Existing annotation must be cleared first: "
                f"xs.clear_sharding(t), then mark it again.")
    value = core.value(t)
    if value.manual:
        raise ShardingAnnotationError(
            "Cannot annotate a tensor inside a manual sharding region; annotate the region's "
            "output after disable_manual_sharding.")
    core.set_annotation(t, annotation)
    if value.is_data:
        core.write(t, reshard_data(value, annotation))
    else:
        core.write(t, core.constrain(value, annotation))
    grads_like_param(t)


def grads_like_param(param: torch.Tensor) -> None:
    """Makes ``param``'s gradients live sharded like ``param`` (once per parameter)."""
    if param.is_leaf and param.requires_grad and not getattr(param, "_xshard_grad_hook", False):
        param.register_post_accumulate_grad_hook(_grad_like_param)
        param._xshard_grad_hook = True


def _grad_like_param(param: torch.Tensor) -> None:
    """A parameter's gradient lives sharded like the parameter (and so does what torch.optim
    derives from it), unless it carries an annotation of its own."""
    grad = param.grad
    annotation = core.annotation(param)
    if not isinstance(grad, XTensor) or annotation is None or \
            tuple(grad.shape) != tuple(param.shape):
        return
    if core.is_view(grad):  # a view of a temporary (e.g. the transpose of a matmul): own storage
        with torch.no_grad():
            grad = grad.clone()
        param.grad = grad
    if core.annotation(grad) is None:
        core.set_annotation(grad, annotation)


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Removes ``t``'s annotation; ``get_sharding_spec(t)`` is then ''.

    Device data goes back to the default layout (replicated on every device), as for any
    unannotated tensor; a pending value loses the constraint its mark added. XLA may still choose to
    shard a later result of a sync.

    Returns:
        ``t``.
    """
    t = device_tensor(t, "clear_sharding")
    _base_only(t, "clear_sharding")
    core.set_annotation(t, None)
    value = core.value(t)
    if value.manual:
        return t
    if value.is_data:
        new = core.relayout(value, core.default_sharding())
        if new is not value:
            core.write(t, new)
    elif value.op == ir.CONSTRAIN:
        core.write(t, value.inputs[0])
    return t


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh, partition_spec) -> torch.Tensor:
    """A copy of ``t`` constrained to the sharding, whose gradient is constrained the same way.

    Unlike ``mark_sharding`` it does not change ``t``: use the result in the computation.
    """
    t = device_tensor(t, "mark_sharding_with_gradients")
    annotation = sh.annotation(mesh, partition_spec, t.dim())
    return ShardWithGradient.apply(t, annotation)


def constrained(t: XTensor, annotation: sh.Annotation) -> XTensor:
    """A new tensor: ``t``'s value constrained to ``annotation`` (and annotated with it)."""
    return core.new_tensor(core.constrain(core.value(t), annotation), annotation)


class ShardWithGradient(torch.autograd.Function):
    """``constrained(t, annotation)``, whose gradient is constrained the same way."""

    @staticmethod
    def forward(ctx, t, annotation):
        ctx.annotation = annotation
        return constrained(t, annotation)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, XTensor):
            return grad, None
        return constrained(grad, ctx.annotation), None
