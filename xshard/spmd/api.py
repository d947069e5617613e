"""Annotating tensors with shardings: mark_sharding, clear_sharding and what reads them back.

A mark on device data reshards the data now; a mark on a pending value becomes a sharding constraint
in the graph. Either way the annotation is stored on the tensor's storage (its cell), so it survives
sync, in-place ops, clone and deepcopy, and every later result of a sync for that tensor is laid out
as annotated.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from xshard.core import graph, ir, runtime
from xshard.core.tensor import XTensor
from xshard.mesh import Mesh
from xshard.spmd import sharding as sh
from xshard.spmd.spec import ShardingType

if TYPE_CHECKING:
    from xshard.spmd.sharded_tensor import XLAShardedTensor


class ShardingAnnotationError(RuntimeError):
    pass


def _device_tensor(t, what: str) -> XTensor:
    from xshard.spmd.sharded_tensor import XLAShardedTensor

    if isinstance(t, XLAShardedTensor):
        t = t.global_tensor
    if not isinstance(t, XTensor):
        device = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(
            f"{what} needs a tensor on the xshard device, got {device}. Move it first: "
            f"t = t.to(xshard.device()).")
    return t


def _base_only(t: XTensor, what: str) -> None:
    if t._chain:
        raise ValueError(
            f"{what} annotates a tensor's whole storage, but this tensor (shape {tuple(t.shape)}) "
            f"is a view of another tensor. Annotate the base tensor, or a copy: "
            f"{what}(t.clone(), ...).")


@functools.lru_cache(maxsize=256)
def _resharder(logical_shape, padded_shape, jax_sharding):
    jax = runtime.jax_module()

    def reshard(x):
        if x.shape != logical_shape:
            x = x[tuple(slice(0, n) for n in logical_shape)]
        pads = [(0, p - n, 0) for n, p in zip(logical_shape, padded_shape)]
        if any(hi for _, hi, _ in pads):
            x = jax.lax.pad(x, jax.numpy.zeros((), x.dtype), pads)
        return x

    return jax.jit(reshard, out_shardings=jax_sharding)


def reshard_data(node: ir.Node, annotation: sh.Annotation) -> ir.Node:
    """Device data laid out as ``annotation`` says (padded at the end where dims don't divide)."""
    padded = annotation.padded_shape(node.shape)
    jax = runtime.jax_module()
    if isinstance(node.payload, jax.ShapeDtypeStruct):  # compile-only data: no values to move
        aval = jax.ShapeDtypeStruct(padded, node.payload.dtype, sharding=annotation.jax_sharding)
        return ir.data_node(aval, node.shape, node.dtype, annotation.jax_sharding)
    fn = _resharder(tuple(node.shape), padded, annotation.jax_sharding)
    array = fn(node.payload)
    return ir.data_node(array, node.shape, node.dtype, array.sharding)


def upload_sharded(cpu: torch.Tensor, annotation: sh.Annotation) -> ir.Node:
    """Copies a CPU tensor straight into its shards (no replicated copy on the devices)."""
    logical = tuple(cpu.shape)
    padded = annotation.padded_shape(logical)
    if padded != logical:
        full = torch.zeros(padded, dtype=cpu.dtype, device=cpu.device)
        full[tuple(slice(0, n) for n in logical)] = cpu
        cpu = full
    node = graph.upload_node(cpu, annotation.jax_sharding)
    return ir.data_node(node.payload, logical, node.dtype, node.sharding)


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec) -> "XLAShardedTensor":
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
    from xshard.spmd.sharded_tensor import XLAShardedTensor

    t = _device_tensor(t, "mark_sharding")
    _base_only(t, "mark_sharding")
    annotation = sh.annotation(mesh, partition_spec, t.dim())
    _annotate(t, annotation)
    return XLAShardedTensor.wrap(t)


def _annotate(t: XTensor, annotation: sh.Annotation) -> None:
    cell = t._cell
    current = cell.sharding
    if current is not None:
        if current == annotation:
            return
        if current.sharding_type != ShardingType.REPLICATED:
            raise ShardingAnnotationError(
                f"This tensor is already annotated {current.hlo_sharding}; the new annotation "
                f"{annotation.hlo_sharding} differs. Existing annotation must be cleared first: "
                f"xs.clear_sharding(t), then mark it again.")
    value = cell.value
    if value.manual:
        raise ShardingAnnotationError(
            "Cannot annotate a tensor inside a manual sharding region; annotate the region's "
            "output after disable_manual_sharding.")
    cell.sharding = annotation
    if value.is_data:
        cell.write(reshard_data(value, annotation))
    else:
        cell.write(graph.constrain(value, annotation))
    if t.is_leaf and t.requires_grad and not getattr(t, "_xshard_grad_hook", False):
        t.register_post_accumulate_grad_hook(_grad_like_param)
        t._xshard_grad_hook = True


def _grad_like_param(param: torch.Tensor) -> None:
    """A parameter's gradient lives sharded like the parameter (and so does what torch.optim
    derives from it), unless it carries an annotation of its own."""
    grad = param.grad
    annotation = param._cell.sharding
    if not isinstance(grad, XTensor) or annotation is None or \
            tuple(grad.shape) != tuple(param.shape):
        return
    if grad._chain:  # a view of a temporary (e.g. the transpose of a matmul): own storage
        with torch.no_grad():
            grad = grad.clone()
        param.grad = grad
    if grad._cell.sharding is None:
        grad._cell.sharding = annotation


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    """Removes ``t``'s annotation; ``get_sharding_spec(t)`` is then ''.

    Device data goes back to the default layout (replicated on every device), as for any
    unannotated tensor; a pending value loses the constraint its mark added. XLA may still choose to
    shard a later result of a sync.

    Returns:
        ``t``.
    """
    t = _device_tensor(t, "clear_sharding")
    _base_only(t, "clear_sharding")
    cell = t._cell
    cell.sharding = None
    value = cell.value
    if value.manual:
        return t
    if value.is_data:
        jax = runtime.jax_module()
        if isinstance(value.payload, jax.ShapeDtypeStruct):  # compile-only data: no values
            aval = jax.ShapeDtypeStruct(tuple(value.shape), value.payload.dtype,
                                        sharding=graph.default_sharding())
            cell.write(ir.data_node(aval, value.shape, value.dtype, aval.sharding))
        elif get_sharding_spec(t):
            array = _replicator(tuple(value.shape))(value.payload)
            cell.write(ir.data_node(array, value.shape, value.dtype, array.sharding))
    elif value.op == graph.CONSTRAIN:
        cell.write(value.inputs[0])
    return t


@functools.lru_cache(maxsize=256)
def _replicator(logical_shape):
    def replicate(x):
        if x.shape != logical_shape:  # drop the padding of an uneven sharding
            x = x[tuple(slice(0, n) for n in logical_shape)]
        return x

    return runtime.jax_module().jit(replicate, out_shardings=graph.default_sharding())


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh, partition_spec) -> torch.Tensor:
    """A copy of ``t`` constrained to the sharding, whose gradient is constrained the same way.

    Unlike ``mark_sharding`` it does not change ``t``: use the result in the computation.
    """
    t = _device_tensor(t, "mark_sharding_with_gradients")
    annotation = sh.annotation(mesh, partition_spec, t.dim())
    return _ShardWithGradient.apply(t, annotation)


def _constrained(t: XTensor, annotation: sh.Annotation) -> XTensor:
    from xshard.core import tensor as xt

    out = xt.new_base(graph.constrain(t._value(), annotation))
    out._cell.sharding = annotation
    return out


class _ShardWithGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, annotation):
        ctx.annotation = annotation
        return _constrained(t, annotation)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, XTensor):
            return grad, None
        return _constrained(grad, ctx.annotation), None


def annotation_of(t: torch.Tensor):
    """The ``Annotation`` on ``t``'s storage, or None."""
    t = _device_tensor(t, "annotation_of")
    return t._cell.sharding


def get_sharding_spec(t: torch.Tensor) -> str:
    """The HLO sharding string of ``t`` in PyTorch/XLA's explicit format, '' when unannotated.

    For a tensor computed by a sync without an annotation, this is the layout XLA chose (or ''
    when XLA left it replicated). Pending values without an annotation report ''.

    Example:
        >>> xs.get_sharding_spec(w)  # doctest: +SKIP
        '{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    t = _device_tensor(t, "get_sharding_spec")
    if t._chain:
        return ""
    annotation = t._cell.sharding
    if annotation is not None:
        return annotation.hlo_sharding
    value = t._cell.value
    if value.is_data and value.sharding is not None:
        text = sh.hlo_string_of_jax_sharding(value.payload.sharding, len(value.shape))
        return "" if text == "{replicated}" else text
    return ""


def get_sharding_type(t: torch.Tensor) -> ShardingType | None:
    """``ShardingType`` of ``t`` (REPLICATED, TILED, PARTIAL, MANUAL...), or None if unannotated."""
    t = _device_tensor(t, "get_sharding_type")
    annotation = t._cell.sharding if not t._chain else None
    if annotation is not None:
        return annotation.sharding_type
    return sh.type_of_hlo_string(get_sharding_spec(t))


def wrap_if_sharded(x):
    """``XLAShardedTensor`` for a device tensor that has a sharding, else ``x`` unchanged."""
    from xshard.spmd.sharded_tensor import XLAShardedTensor

    if isinstance(x, XTensor) and not isinstance(x, XLAShardedTensor) and get_sharding_spec(x):
        return XLAShardedTensor.wrap(x)
    return x
