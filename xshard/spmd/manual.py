"""Manual sharding regions and the collectives used inside them.

Inside a region code sees each device's shard (the *local* shape) and communicates explicitly with
``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``ppermute`` over named mesh
axes. A region is opened by ``enable_manual_sharding`` (or by ``shard_map``) and closed by
``disable_manual_sharding``; the ops in between become one ``jax.shard_map`` call in the graph.

[Note: regions in a lazy graph]
Entering records a ``manual_enter`` node (local shape) on the padded global value. Values derived from
it are marked ``manual`` in the IR (see ``xshard.core.ir``): a sync leaves them pending and reading one
is an error, because a per-device value has no global meaning until the region is closed. Closing
linearises the region's subgraph down to its entry nodes, stores its program under its structural key,
and records one ``manual_region`` node whose lowering is ``jax.shard_map(program, ...)``. Device data
or scalars used inside a region without entering it are passed in replicated.

Example:
    >>> local = xs.enable_manual_sharding(x, ("data", None), mesh=mesh)   # doctest: +SKIP
    >>> local = xs.all_reduce(local * 2, "data")
    >>> y = xs.disable_manual_sharding(local, ("data", None), x.shape, mesh=mesh)
"""

from __future__ import annotations

import torch

from xshard.core import api as core
from xshard.core import ir, runtime
from xshard.core.compiler import Program
from xshard.core.graph import Graph
from xshard.core.lowering.xshard_ops import REGION_PROGRAMS, ManualRegionError
from xshard.mesh import Mesh, get_global_mesh
from xshard.spmd import sharding as sh
from xshard.spmd.api import device_tensor

__all__ = ["enable_manual_sharding", "disable_manual_sharding", "shard_map", "all_reduce",
           "all_gather", "reduce_scatter", "all_to_all", "ppermute", "ManualRegionError"]


def _mesh(mesh: Mesh | None) -> Mesh:
    mesh = mesh if mesh is not None else get_global_mesh()
    if mesh is None:
        raise ValueError(
            "No mesh given and no global mesh set; pass mesh=... or call xs.set_global_mesh(mesh).")
    return mesh


def _no_grad_check(t: torch.Tensor, what: str) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        raise ManualRegionError(
            f"{what}: manual sharding regions are not differentiable in xshard; run the region "
            f"under torch.no_grad(), or use mark_sharding (which autograd follows) instead.")


def enable_manual_sharding(t: torch.Tensor, partition_spec, *, mesh: Mesh | None = None
                           ) -> torch.Tensor:
    """Opens a manual region: returns this device's shard of ``t`` (shape of one shard).

    Args:
        t: a device tensor (global shape).
        partition_spec: how ``t`` is split (as in ``mark_sharding``).
        mesh: the mesh; defaults to the global mesh.

    Returns:
        A tensor of the padded shard shape whose sharding type is MANUAL.
    """
    t = device_tensor(t, "enable_manual_sharding")
    _no_grad_check(t, "enable_manual_sharding")
    mesh = _mesh(mesh)
    annotation = sh.annotation(mesh, partition_spec, t.dim())
    value = core.value(t)
    if value.manual:
        raise ManualRegionError("enable_manual_sharding got a tensor that is already manual.")
    value = core.pad_node(value, annotation.padded_shape(value.shape))
    local = annotation.shard_shape(value.shape)
    node = ir.Node(ir.MANUAL_ENTER, (value,), ((ir.slot(0), annotation.partition_spec), ()), local,
                   value.dtype)
    return core.new_tensor(node, sh.Annotation(mesh, annotation.spec, manual=True))


def disable_manual_sharding(t: torch.Tensor, partition_spec, full_shape, *,
                            mesh: Mesh | None = None) -> torch.Tensor:
    """Closes a manual region: the global tensor of shape ``full_shape`` made of the shards ``t``.

    Args:
        t: the local (per-device) result of the region.
        partition_spec: how the shards tile the global tensor.
        full_shape: the global (unpadded) shape.
        mesh: the mesh; defaults to the global mesh.
    """
    t = device_tensor(t, "disable_manual_sharding")
    mesh = _mesh(mesh)
    full_shape = tuple(int(n) for n in full_shape)
    annotation = sh.annotation(mesh, partition_spec, len(full_shape))
    expected = annotation.shard_shape(full_shape)
    if tuple(t.shape) != expected:
        raise ValueError(
            f"disable_manual_sharding: a shard of {full_shape} split by {partition_spec} has shape "
            f"{expected}, but the tensor has shape {tuple(t.shape)}. Pass the global shape the "
            f"shards belong to.")
    (out,) = _close_region([t], [annotation], mesh, [full_shape])
    return out


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """Wraps ``fn`` to run on each device's shards, like ``jax.shard_map``.

    Args:
        fn: takes local tensors (one per input) and returns a tensor or a tuple of tensors; it may
            call the collectives of this module.
        mesh: the mesh.
        in_specs: one partition spec per input.
        out_specs: a partition spec when ``fn`` returns a tensor; a tuple with one spec per output
            when it returns a tuple or list.

    Returns:
        A function of global tensors returning global tensors.

    Example:
        >>> total = xs.shard_map(lambda x: xs.all_reduce(x.sum(0), "data"), mesh,
        ...                      in_specs=(("data", None),), out_specs=(None,))(x)  # doctest: +SKIP
        >>> a, b = xs.shard_map(lambda x: (x + 1, x.sum(0)), mesh, in_specs=(("data", None),),
        ...                     out_specs=(("data", None), ("data",)))(x)  # doctest: +SKIP
    """
    def wrapped(*tensors):
        if len(tensors) != len(in_specs):
            raise ValueError(f"shard_map got {len(tensors)} inputs for {len(in_specs)} in_specs.")
        for k, (t, spec) in enumerate(zip(tensors, in_specs)):
            _check_even(t, spec, mesh, k)
        locals_ = [enable_manual_sharding(t, s, mesh=mesh) for t, s in zip(tensors, in_specs)]
        result = fn(*locals_)
        # What fn returns decides how out_specs reads: one spec for a tensor, one spec per output
        # for a tuple or list (a spec alone cannot tell: (("a", "b"), ("c",)) could be either).
        single = isinstance(result, torch.Tensor)
        if not single and not isinstance(result, (tuple, list)):
            raise TypeError(f"shard_map: fn must return a tensor or a tuple of tensors, got "
                            f"{type(result).__name__}.")
        outs = [result] if single else list(result)
        specs = [out_specs] if single else list(out_specs)
        if len(outs) != len(specs):
            raise ValueError(f"shard_map: fn returned {len(outs)} outputs for {len(specs)} "
                             f"out_specs.")
        annotations = [sh.annotation(mesh, s, o.dim()) for o, s in zip(outs, specs)]
        full = [tuple(n * k for n, k in zip(o.shape, a.plan.tile_shape))
                for o, a in zip(outs, annotations)]
        results = _close_region(outs, annotations, mesh, full)
        return results[0] if single else tuple(results)

    return wrapped


def _check_even(t, spec, mesh: Mesh, k: int) -> None:
    """As ``jax.shard_map``: each sharded dim of input ``k`` divides evenly over its mesh axes
    (``fn`` would see the padding of the last shards, and its results would keep it)."""
    tiles = sh.annotation(mesh, spec, t.dim()).plan.tile_shape
    for d, (n, parts) in enumerate(zip(t.shape, tiles)):
        if n % parts:
            raise ValueError(
                f"shard_map: input {k} (shape {list(t.shape)}) has dim {d} of size {n} split "
                f"{parts} ways by in_specs[{k}] = {spec!r}, which does not divide evenly; pad "
                f"that dim to a multiple of {parts}, or replicate it (None in the spec).")


def _close_region(outputs, annotations, mesh: Mesh, full_shapes):
    values = []
    for t in outputs:
        t = device_tensor(t, "a manual region's output")
        values.append(core.value(t))
    region = Graph(values, boundary=(ir.MANUAL_ENTER,))
    if region.key not in REGION_PROGRAMS:
        REGION_PROGRAMS[region.key] = Program(region)
    operands, in_specs = [], []
    jax = runtime.jax_module()
    for node in region.inputs:
        if node.op is ir.MANUAL_ENTER:
            operands.append(node.inputs[0])
            in_specs.append(node.template[0][1])
        else:
            operands.append(node)
            in_specs.append(jax.sharding.PartitionSpec())
    out_specs = tuple(a.partition_spec for a in annotations)
    padded = [a.padded_shape(s) for a, s in zip(annotations, full_shapes)]
    metas = tuple((p, v.dtype) for p, v in zip(padded, values))
    template = ((tuple(ir.slot(i) for i in range(len(operands))), region.key, tuple(in_specs),
                 out_specs, mesh.get_jax_mesh()), ())
    node = ir.Node(ir.MANUAL_REGION, tuple(operands), template, outputs=metas)
    return [core.new_tensor(core.crop_node(ir.output_node(node, i), full), annotation)
            for i, (annotation, full) in enumerate(zip(annotations, full_shapes))]


# -- collectives ---------------------------------------------------------------------------------


def _axes(axes, mesh: Mesh | None):
    if isinstance(axes, (str, int)):
        axes = (axes,)
    mesh = mesh if mesh is not None else get_global_mesh()
    names = []
    for a in axes:
        if isinstance(a, int) or mesh is not None:
            if mesh is None:
                raise ValueError(f"mesh axis {a!r} given by index needs mesh=... or a global mesh.")
            idx = mesh.axis_index(a)
            names.append(mesh.axis_names[idx] if mesh.axis_names else f"axis_{idx}")
        else:
            names.append(a)
    return tuple(names), mesh


def _collective(op: str, t: torch.Tensor, static: tuple, shape) -> torch.Tensor:
    t = device_tensor(t, op)
    _no_grad_check(t, op)
    value = core.value(t)
    if not value.manual:
        raise ManualRegionError(
            f"xs.{op} runs inside a manual sharding region (enable_manual_sharding or "
            f"xs.shard_map); this tensor is a global value. Open a region first.")
    node = ir.Node(_COLLECTIVES[op], (value,), ((ir.slot(0), *static), ()), tuple(shape),
                   value.dtype)
    return core.new_tensor(node)


_COLLECTIVES = {"all_reduce": ir.ALL_REDUCE, "all_gather": ir.ALL_GATHER,
                "reduce_scatter": ir.REDUCE_SCATTER, "all_to_all": ir.ALL_TO_ALL,
                "ppermute": ir.PPERMUTE}


def _axis_size(names, mesh: Mesh | None) -> int:
    if mesh is None:
        raise ValueError("this collective needs the mesh to know the axis size: pass mesh=... or "
                         "set a global mesh.")
    sizes = dict(zip(mesh.axis_names or [f"axis_{i}" for i in range(mesh.ndim)], mesh.mesh_shape))
    total = 1
    for n in names:
        total *= sizes[n]
    return total


_REDUCE_OPS = ("sum", "mean", "max", "min")


def all_reduce(t: torch.Tensor, axes, reduce_op: str = "sum", *, mesh: Mesh | None = None):
    """Reduces ``t`` over the devices of mesh ``axes`` (a name or tuple of names); every device
    gets the result."""
    if reduce_op not in _REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r}; choose one of {_REDUCE_OPS}.")
    names, _ = _axes(axes, mesh)
    return _collective("all_reduce", t, (names, reduce_op), t.shape)


def all_gather(t: torch.Tensor, dim: int, axes, *, mesh: Mesh | None = None):
    """Concatenates the shards of ``t`` along ``dim`` over mesh ``axes``."""
    names, mesh = _axes(axes, mesh)
    dim = dim % t.dim()
    shape = list(t.shape)
    shape[dim] *= _axis_size(names, mesh)
    return _collective("all_gather", t, (names, dim), shape)


def reduce_scatter(t: torch.Tensor, dim: int, axes, *, mesh: Mesh | None = None):
    """Sums ``t`` over mesh ``axes`` and leaves each device one block of ``dim``."""
    names, mesh = _axes(axes, mesh)
    dim = dim % t.dim()
    size = _axis_size(names, mesh)
    if t.shape[dim] % size:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {t.shape[dim]} does not divide "
                         f"into {size} blocks (the size of mesh axes {names}); pad it first.")
    shape = list(t.shape)
    shape[dim] //= size
    return _collective("reduce_scatter", t, (names, dim), shape)


def all_to_all(t: torch.Tensor, split_dim: int, concat_dim: int, axes, *,
               mesh: Mesh | None = None):
    """Splits ``split_dim`` into blocks sent to each device of ``axes``, concatenated on
    ``concat_dim``."""
    names, mesh = _axes(axes, mesh)
    split_dim, concat_dim = split_dim % t.dim(), concat_dim % t.dim()
    size = _axis_size(names, mesh)
    if t.shape[split_dim] % size:
        raise ValueError(f"all_to_all: split dimension {split_dim} of size {t.shape[split_dim]} "
                         f"does not divide into {size} blocks.")
    shape = list(t.shape)
    shape[split_dim] //= size
    shape[concat_dim] *= size
    return _collective("all_to_all", t, (names, split_dim, concat_dim), shape)


def ppermute(t: torch.Tensor, axis, perm, *, mesh: Mesh | None = None):
    """Sends each device's ``t`` to another along ``axis``: ``perm`` lists (source, destination)
    positions on that axis; devices that receive nothing get zeros."""
    names, _ = _axes(axis, mesh)
    if len(names) != 1:
        raise ValueError("ppermute takes a single mesh axis.")
    perm = tuple((int(a), int(b)) for a, b in perm)
    return _collective("ppermute", t, (names[0], perm), t.shape)
