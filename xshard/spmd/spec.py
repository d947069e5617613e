"""Device-free sharding math: partition specs, tile assignments, HLO strings.

Everything here works on plain values (device IDs, a mesh shape, axis names),
never on devices or tensors, so it can be computed and cached while tracing.
The data flows in one direction:

    user partition spec --normalize_spec--> canonical spec
    canonical spec --plan_sharding--> ShardingPlan (tiles, devices, HLO string)
    ShardingPlan --shard_indices / shard_shape--> per-device slices of a tensor

A *canonical spec* has one entry per tensor dimension; each entry is None
(the dimension is replicated) or a non-empty tuple of mesh axis indices (the
dimension is split over those axes, the first one major). For example, on a
mesh with axes ('data', 'model'), the user spec ('model', None) becomes
((1,), None) and (('data', 'model'),) becomes ((0, 1),).

The rules follow PyTorch/XLA's ``Mesh.get_op_sharding`` and XLA's
``HloSharding`` normalisation; see [Note: tile assignment] below.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from types import EllipsisType
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
from jax.sharding import PartitionSpec

__all__ = [
    "CanonicalSpec",
    "PartitionSpecError",
    "PartitionSpecTypeError",
    "ShardIndex",
    "ShardingPlan",
    "ShardingType",
    "normalize_spec",
    "padded_shape",
    "plan_for_mesh",
    "plan_sharding",
    "shard_indices",
    "shard_shape",
    "to_jax_partition_spec",
]

AxisRef = Union[int, str]
SpecEntry = Union[None, AxisRef, Sequence[AxisRef]]
CanonicalSpec = tuple[Optional[tuple[int, ...]], ...]


class ShardingType(enum.IntEnum):
    """Kinds of sharding, with PyTorch/XLA's values (``torch_xla...ShardingType``).

    xshard produces REPLICATED, TILED and PARTIAL from partition specs; the
    other values exist so that codes read back from XLA compare equal.
    """

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


class PartitionSpecError(ValueError):
    """A partition spec does not fit the tensor rank or the mesh.

    Attributes:
        spec: the partition spec as the user gave it.
        dim: the offending tensor dimension, or None if the whole spec is wrong.
    """

    def __init__(self, message: str, *, spec: Any, dim: Optional[int] = None):
        super().__init__(message)
        self.spec = spec
        self.dim = dim


class PartitionSpecTypeError(PartitionSpecError, TypeError):
    """A partition spec entry has the wrong type (e.g. a float or a bool).

    Also a ValueError, so ``except ValueError`` catches every bad spec.
    """


# --------------------------------------------------------------------------
# Validation: user spec -> canonical spec
# --------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a mesh axis is a bug, not axis 1.
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _mesh_axes_text(mesh_shape: tuple[int, ...], axis_names) -> str:
    if axis_names is not None:
        return f"the mesh axes are {tuple(axis_names)!r}"
    return f"the mesh axes are unnamed, with sizes {tuple(mesh_shape)!r}"


def _choices_text(mesh_shape: tuple[int, ...], axis_names) -> str:
    n = len(mesh_shape)
    if axis_names is not None:
        return f"Use one of these names, an axis index in [0, {n}), or None."
    return (
        f"Use an axis index in [0, {n}) or None, or give the mesh axis_names "
        "to refer to axes by name."
    )


def _axis_text(axis: int, axis_names) -> str:
    if axis_names is None:
        return f"mesh axis {axis}"
    return f"mesh axis {axis_names[axis]!r} (index {axis})"


def normalize_spec(
    partition_spec: Sequence[SpecEntry],
    ndim: int,
    mesh_shape: Sequence[int],
    axis_names: Optional[Sequence[str]] = None,
) -> CanonicalSpec:
    """Validates a PyTorch/XLA-style partition spec and returns its canonical form.

    Each entry of ``partition_spec`` describes one tensor dimension:

    * an int: the index of the mesh axis that splits this dimension;
    * a str: the name of that mesh axis;
    * a tuple (or list) of ints/strs: several mesh axes split this dimension,
      the first one major; an empty tuple means None;
    * None: the dimension is replicated.

    Each mesh axis may appear at most once. Mesh axes the spec does not use
    replicate the tensor.

    Args:
        partition_spec: a tuple or list with one entry per tensor dimension.
        ndim: the rank of the tensor being sharded.
        mesh_shape: the size of each mesh axis, e.g. ``(2, 4)``.
        axis_names: one name per mesh axis, or None if the axes are unnamed.

    Returns:
        A tuple with one entry per dimension: None, or a tuple of mesh axis
        indices. It is hashable and can be passed to ``plan_sharding``.

    Raises:
        PartitionSpecError (a ValueError): wrong length, unknown axis name,
            axis index out of range, or a mesh axis used twice.
        PartitionSpecTypeError (a TypeError and a PartitionSpecError): an
            entry of the wrong type (bool, float, nested tuple, ...).

    Example:
        >>> normalize_spec(("model", None), 2, (2, 4), ("data", "model"))
        ((1,), None)
        >>> normalize_spec(((0, "model"), None), 2, (2, 4), ("data", "model"))
        ((0, 1), None)
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    axis_names = None if axis_names is None else tuple(axis_names)
    if axis_names is not None and len(axis_names) != len(mesh_shape):
        raise ValueError(
            f"Got {len(axis_names)} axis names {axis_names!r} for a mesh with "
            f"{len(mesh_shape)} axes {mesh_shape!r}. Give one name per mesh "
            "axis, or axis_names=None."
        )
    if not _is_int(ndim) or ndim < 0:
        raise TypeError(f"ndim must be a non-negative int, got {ndim!r}.")
    mesh_text = _mesh_axes_text(mesh_shape, axis_names)
    choices = _choices_text(mesh_shape, axis_names)

    if not isinstance(partition_spec, (tuple, list)):
        raise PartitionSpecTypeError(
            f"Partition spec must be a tuple with one entry per tensor "
            f"dimension, got {type(partition_spec).__name__} "
            f"{partition_spec!r} for a rank-{ndim} tensor; {mesh_text}. Write "
            f"it as a tuple, e.g. {(None,) * ndim!r} to replicate.",
            spec=partition_spec,
        )
    spec_text = repr(tuple(partition_spec))
    if len(partition_spec) != ndim:
        raise PartitionSpecError(
            f"Partition spec {spec_text} has {len(partition_spec)} entries, "
            f"but the tensor has rank {ndim}; {mesh_text}. Give exactly one "
            "entry per tensor dimension, using None for dimensions that are "
            "not split.",
            spec=partition_spec,
        )

    def resolve(ref: Any, dim: int) -> int:
        """Returns the mesh axis index that ``ref`` names at tensor dim ``dim``."""
        if isinstance(ref, (bool, np.bool_)):
            raise PartitionSpecTypeError(
                f"Partition spec {spec_text} for a rank-{ndim} tensor has the "
                f"bool {ref!r} at dimension {dim}, which is not a mesh axis; "
                f"{mesh_text}. {choices}",
                spec=partition_spec,
                dim=dim,
            )
        if _is_int(ref):
            if not 0 <= ref < len(mesh_shape):
                raise PartitionSpecError(
                    f"Partition spec {spec_text} for a rank-{ndim} tensor uses "
                    f"mesh axis index {int(ref)} at dimension {dim}, but the "
                    f"mesh has {len(mesh_shape)} axes and {mesh_text}. "
                    f"{choices}",
                    spec=partition_spec,
                    dim=dim,
                )
            return int(ref)
        if isinstance(ref, str):
            if axis_names is None or ref not in axis_names:
                raise PartitionSpecError(
                    f"Partition spec {spec_text} for a rank-{ndim} tensor "
                    f"names mesh axis {ref!r} at dimension {dim}, but "
                    f"{mesh_text}. {choices}",
                    spec=partition_spec,
                    dim=dim,
                )
            return axis_names.index(ref)
        if isinstance(ref, (tuple, list)):
            raise PartitionSpecTypeError(
                f"Partition spec {spec_text} for a rank-{ndim} tensor nests "
                f"{ref!r} inside the tuple at dimension {dim}; {mesh_text}. "
                "List the mesh axes of one dimension in a flat tuple, e.g. "
                "(0, 1), major axis first.",
                spec=partition_spec,
                dim=dim,
            )
        raise PartitionSpecTypeError(
            f"Partition spec {spec_text} for a rank-{ndim} tensor has "
            f"{ref!r} of type {type(ref).__name__} at dimension {dim}, but an "
            "entry must be a mesh axis name (str), a mesh axis index (int), a "
            f"tuple of those, or None; {mesh_text}. {choices}",
            spec=partition_spec,
            dim=dim,
        )

    canonical: list[Optional[tuple[int, ...]]] = []
    used_at: dict[int, int] = {}  # mesh axis -> tensor dim that uses it
    for dim, entry in enumerate(partition_spec):
        if entry is None:
            canonical.append(None)
            continue
        refs = entry if isinstance(entry, (tuple, list)) else (entry,)
        axes = tuple(resolve(ref, dim) for ref in refs)
        for axis in axes:
            if axis in used_at:
                where = (
                    f"twice at dimension {dim}"
                    if used_at[axis] == dim
                    else f"at dimensions {used_at[axis]} and {dim}"
                )
                raise PartitionSpecError(
                    f"Partition spec {spec_text} for a rank-{ndim} tensor uses "
                    f"{_axis_text(axis, axis_names)} {where}, but each mesh "
                    f"axis can split at most one dimension, once; {mesh_text}. "
                    "Keep the axis in one place and use None or another mesh "
                    "axis elsewhere.",
                    spec=partition_spec,
                    dim=dim,
                )
            used_at[axis] = dim
        canonical.append(axes or None)  # An empty tuple means replicated.
    return tuple(canonical)


def _check_canonical(spec: Any, num_axes: Optional[int]) -> None:
    """Raises if ``spec`` is not the output of ``normalize_spec``."""
    problem = None
    if not isinstance(spec, tuple):
        problem = f"it is a {type(spec).__name__}, not a tuple"
    else:
        seen: set[int] = set()
        for dim, entry in enumerate(spec):
            if entry is None:
                continue
            if not isinstance(entry, tuple) or not entry:
                problem = (
                    f"entry {entry!r} at dimension {dim} is not None or a "
                    "non-empty tuple"
                )
                break
            for axis in entry:
                if not _is_int(axis) or axis < 0 or (
                    num_axes is not None and axis >= num_axes
                ):
                    problem = (
                        f"entry {entry!r} at dimension {dim} holds {axis!r}, "
                        "not a mesh axis index"
                    )
                    break
                if axis in seen:
                    problem = f"mesh axis {axis} appears twice"
                    break
                seen.add(axis)
            if problem:
                break
    if problem:
        raise ValueError(
            f"{spec!r} is not a canonical partition spec: {problem}. Pass the "
            "user's spec through normalize_spec() first."
        )


# --------------------------------------------------------------------------
# Planning: canonical spec -> tile assignment and HLO sharding string
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """How a tensor of some rank is laid out over a mesh, for one spec.

    Build it with ``plan_sharding`` (or ``plan_for_mesh``); it is frozen,
    hashable and independent of the tensor's shape (only its rank matters).

    Attributes:
        device_ids: the mesh's device IDs, in mesh (row-major) order.
        mesh_shape: the size of each mesh axis.
        spec: the canonical partition spec.
        tile_shape: the number of tiles along each tensor dimension.
        replicate_factor: the product of the mesh axes the spec does not use;
            each tile is held by this many devices.
        tile_assignment_devices: the device IDs of ``tile_assignment``,
            flattened row-major.
        sharding_type: REPLICATED, PARTIAL or TILED.
        hlo_sharding: XLA's V1 sharding string, as PyTorch/XLA prints it,
            e.g. ``{devices=[4,2]0,4,1,5,2,6,3,7}``.
    """

    device_ids: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    spec: CanonicalSpec
    tile_shape: tuple[int, ...]
    replicate_factor: int
    tile_assignment_devices: tuple[int, ...]
    sharding_type: ShardingType
    hlo_sharding: str

    @property
    def tile_assignment(self) -> np.ndarray:
        """Device IDs, shape ``(*tile_shape, replicate_factor)``, groups sorted.

        Entry ``[i_0, ..., i_{n-1}, r]`` is the device holding tile
        ``(i_0, ..., i_{n-1})`` as member ``r`` of its replication group. The
        last axis is always present, even when ``replicate_factor`` is 1.
        """
        array = np.array(self.tile_assignment_devices, dtype=np.int64)
        array = array.reshape(*self.tile_shape, self.replicate_factor)
        array.flags.writeable = False
        return array

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)


# [Note: tile assignment]
# PyTorch/XLA (Mesh.get_op_sharding) lays the devices out as follows, and XLA
# (HloSharding::PartialTile) then normalises the result. Worked example:
# device_ids 7..0 (reversed) on mesh (2, 4) with axes ('data', 'model'), and
# the user spec (None, 'model'), canonical (None, (1,)), for a 2-D tensor.
#
# 1. The logical mesh is device_ids reshaped row-major to mesh_shape:
#        [[7, 6, 5, 4],
#         [3, 2, 1, 0]]
# 2. Transpose it to the mesh axes in spec order (tuples flattened), then the
#    unused axes in ascending order: used = [1], unused = [0], so the
#    permutation is (1, 0):
#        [[7, 3], [6, 2], [5, 1], [4, 0]]
# 3. Reshape to (*tile_shape, replicate_factor): the axes of a tuple entry
#    merge into one tile dimension (major axis first), a None entry is a tile
#    dimension of 1, and the unused axes merge into the last dimension:
#    tile_shape = (1, 4), replicate_factor = 2, shape (1, 4, 2).
# 4. XLA sorts the devices inside each replication group (the last axis):
#        [[[3, 7], [2, 6], [1, 5], [0, 4]]]
# 5. Print: {devices=[1,4,2]3,7,2,6,1,5,0,4 last_tile_dim_replicate}
#
# XLA's normalisation in step 5 also:
# * drops a replication dimension of size 1: mesh (8, 1), spec (0, None) is
#   {devices=[8,1]0,1,2,3,4,5,6,7}, a TILED sharding;
# * prints a single replication group (every tile dimension is 1) as
#   {replicated}: an all-None spec, mesh (1, 8) with spec (0, None), or a
#   mesh of one device.
# tile_assignment keeps the sorted (step 4) layout, so replica positions agree
# with what XLA reports for each device.


def _hlo_sharding_string(
    tile_shape: tuple[int, ...], replicate_factor: int, devices: Sequence[int]
) -> str:
    if math.prod(tile_shape) == 1:
        return "{replicated}"
    dims = list(tile_shape)
    if replicate_factor > 1:
        dims.append(replicate_factor)
    text = "{devices=[" + ",".join(map(str, dims)) + "]"
    text += ",".join(map(str, devices))
    if replicate_factor > 1:
        text += " last_tile_dim_replicate"
    return text + "}"


@functools.lru_cache(maxsize=4096)
def plan_sharding(
    device_ids: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    canonical_spec: CanonicalSpec,
) -> ShardingPlan:
    """Computes the tile assignment and HLO sharding string of a spec. Cached.

    See [Note: tile assignment] in this module for the rule, with a worked
    example. The sharding type is REPLICATED when every tile dimension is 1
    (an all-None spec, a single replication group, or a one-device mesh),
    PARTIAL when each tile is held by several devices, and TILED otherwise.

    A one-device mesh is REPLICATED, not MAXIMAL: PyTorch/XLA labels such an
    annotation MAXIMAL, but XLA stores and prints it as ``{replicated}`` and
    reads it back as REPLICATED, so xshard reports what XLA reports.

    Args:
        device_ids: the mesh's device IDs in row-major order, as a tuple of
            ints (hashable, for the cache).
        mesh_shape: the size of each mesh axis, a tuple of ints.
        canonical_spec: a spec from ``normalize_spec``.

    Returns:
        A frozen ``ShardingPlan``.

    Raises:
        ValueError: the device IDs do not fill the mesh or repeat, or the spec
            is not canonical for this mesh.

    Example:
        >>> plan = plan_sharding(tuple(range(8)), (2, 4), ((1,), (0,)))
        >>> plan.hlo_sharding
        '{devices=[4,2]0,4,1,5,2,6,3,7}'
        >>> plan_sharding(tuple(range(8)), (2, 4), ((0,), None)).hlo_sharding
        '{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    device_ids = tuple(int(d) for d in device_ids)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if any(s < 1 for s in mesh_shape) or len(device_ids) != math.prod(mesh_shape):
        raise ValueError(
            f"The mesh shape {mesh_shape!r} needs {math.prod(mesh_shape)} "
            f"device IDs, got {len(device_ids)}: {device_ids!r}. Every mesh "
            "axis must have a positive size and device_ids must fill the mesh."
        )
    if len(set(device_ids)) != len(device_ids):
        raise ValueError(
            f"Device IDs must be unique, got {device_ids!r}. List each device "
            "once."
        )
    _check_canonical(canonical_spec, len(mesh_shape))
    spec = tuple(
        None if entry is None else tuple(int(a) for a in entry)
        for entry in canonical_spec
    )

    used = [axis for entry in spec if entry is not None for axis in entry]
    unused = [axis for axis in range(len(mesh_shape)) if axis not in used]
    tile_shape = tuple(
        1 if entry is None else math.prod(mesh_shape[a] for a in entry)
        for entry in spec
    )
    replicate_factor = math.prod(mesh_shape[a] for a in unused)

    logical_mesh = np.array(device_ids, dtype=np.int64).reshape(mesh_shape)
    tiles = logical_mesh.transpose(used + unused)
    tiles = tiles.reshape(*tile_shape, replicate_factor)
    tiles = np.sort(tiles, axis=-1)  # XLA's order inside replication groups.
    devices = tuple(int(d) for d in tiles.ravel())

    if math.prod(tile_shape) == 1:
        sharding_type = ShardingType.REPLICATED
    elif replicate_factor > 1:
        sharding_type = ShardingType.PARTIAL
    else:
        sharding_type = ShardingType.TILED

    return ShardingPlan(
        device_ids=device_ids,
        mesh_shape=mesh_shape,
        spec=spec,
        tile_shape=tile_shape,
        replicate_factor=replicate_factor,
        tile_assignment_devices=devices,
        sharding_type=sharding_type,
        hlo_sharding=_hlo_sharding_string(tile_shape, replicate_factor, devices),
    )


def plan_for_mesh(
    mesh: Any, partition_spec: Sequence[SpecEntry], ndim: int
) -> ShardingPlan:
    """Validates a user spec against a mesh and returns its (cached) plan.

    Args:
        mesh: any object with ``device_ids`` (1-D ints), ``mesh_shape`` and
            ``axis_names``, such as ``xshard.mesh.Mesh``.
        partition_spec: a PyTorch/XLA-style spec (see ``normalize_spec``).
        ndim: the rank of the tensor being sharded.

    Returns:
        ``plan_sharding(device_ids, mesh_shape, normalize_spec(...))``.

    Example:
        >>> from types import SimpleNamespace
        >>> mesh = SimpleNamespace(device_ids=np.arange(8), mesh_shape=(2, 4),
        ...                        axis_names=("data", "model"))
        >>> plan_for_mesh(mesh, ("data", None), 2).hlo_sharding
        '{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}'
    """
    mesh_shape = tuple(int(s) for s in mesh.mesh_shape)
    spec = normalize_spec(partition_spec, ndim, mesh_shape, mesh.axis_names)
    device_ids = tuple(int(d) for d in np.asarray(mesh.device_ids).ravel())
    return plan_sharding(device_ids, mesh_shape, spec)


# --------------------------------------------------------------------------
# Shard geometry: uneven shapes are padded at the end of each dimension
# --------------------------------------------------------------------------


def _check_shape(global_shape: Any, tile_shape: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(global_shape, (tuple, list)):  # torch.Size is a tuple.
        raise TypeError(
            f"global_shape must be a tuple of ints, got "
            f"{type(global_shape).__name__} {global_shape!r}."
        )
    shape = tuple(global_shape)
    if len(shape) != len(tile_shape):
        raise ValueError(
            f"The tensor shape {shape!r} has rank {len(shape)}, but the "
            f"sharding has {len(tile_shape)} tile dimensions "
            f"{tuple(tile_shape)!r}. Use a plan made for a rank-{len(shape)} "
            "tensor."
        )
    for size in shape:
        if not _is_int(size) or size < 0:
            raise ValueError(
                f"Tensor shape entries must be non-negative ints, got {size!r} "
                f"in {shape!r}."
            )
    return tuple(int(s) for s in shape)


def shard_shape(
    global_shape: Sequence[int], tile_shape: Sequence[int]
) -> tuple[int, ...]:
    """The padded shape of every shard: ``ceil(dim / tiles)`` per dimension.

    All shards have this shape; for uneven sizes the last shards along a
    dimension are padded at the end (some may hold only padding).

    Args:
        global_shape: the unpadded shape of the whole tensor.
        tile_shape: the number of tiles per dimension (``plan.tile_shape``).

    Returns:
        The per-shard shape, a tuple of ints.

    Example:
        >>> shard_shape((9, 5), (8, 2))
        (2, 3)
    """
    shape = _check_shape(global_shape, tile_shape)
    return tuple(-(-size // tiles) for size, tiles in zip(shape, tile_shape))


def padded_shape(
    global_shape: Sequence[int], tile_shape: Sequence[int]
) -> tuple[int, ...]:
    """The global shape with each dimension rounded up to a multiple of its tiles.

    Args:
        global_shape: the unpadded shape of the whole tensor.
        tile_shape: the number of tiles per dimension (``plan.tile_shape``).

    Returns:
        ``shard_shape(global_shape, tile_shape) * tile_shape``, per dimension.

    Example:
        >>> padded_shape((9, 5), (8, 2))
        (16, 6)
    """
    per_shard = shard_shape(global_shape, tile_shape)
    return tuple(size * tiles for size, tiles in zip(per_shard, tile_shape))


class ShardIndex(NamedTuple):
    """Where one device's shard sits in the global tensor.

    Attributes:
        indices: a tuple of ``slice(start, stop, 1)``, one per dimension, into
            the unpadded global tensor (clipped, so possibly empty such as
            ``slice(9, 9, 1)``), or ``Ellipsis`` when the tensor is replicated.
            Either indexes a tensor directly: ``tensor[index.indices]``.
        replica_id: 0 for TILED; for PARTIAL the device's position in its
            (sorted) replication group; for REPLICATED the device ID itself,
            as PyTorch/XLA uses the device's global ordinal.
    """

    indices: Union[tuple[slice, ...], EllipsisType]
    replica_id: int


def shard_indices(
    global_shape: Sequence[int], plan: ShardingPlan
) -> dict[int, ShardIndex]:
    """The slice of the global tensor each device holds, and its replica id.

    Follows PyTorch/XLA's ``GetShardReplicaAndIndicesForDevices``: shards have
    ``shard_shape`` rows per dimension, the padding is at the end, and the
    slices are clipped to the unpadded tensor.

    Args:
        global_shape: the unpadded shape of the whole tensor.
        plan: a ``ShardingPlan`` for a tensor of this rank.

    Returns:
        A dict from device ID to ``ShardIndex(indices, replica_id)``, in the
        mesh's device order.

    Example:
        >>> plan = plan_sharding(tuple(range(8)), (8,), ((0,),))
        >>> shard_indices((9,), plan)[4]
        ShardIndex(indices=(slice(8, 9, 1),), replica_id=0)
        >>> shard_indices((9,), plan)[5]
        ShardIndex(indices=(slice(9, 9, 1),), replica_id=0)
    """
    shape = _check_shape(global_shape, plan.tile_shape)
    if plan.sharding_type == ShardingType.REPLICATED:
        return {d: ShardIndex(Ellipsis, d) for d in plan.device_ids}

    per_shard = shard_shape(shape, plan.tile_shape)
    assignment = plan.tile_assignment
    by_device: dict[int, ShardIndex] = {}
    for position in np.ndindex(*assignment.shape):
        *tile, replica = position
        slices = tuple(
            slice(min(i * step, size), min((i + 1) * step, size), 1)
            for i, step, size in zip(tile, per_shard, shape)
        )
        device = int(assignment[position])
        by_device[device] = ShardIndex(slices, int(replica))
    return {d: by_device[d] for d in plan.device_ids}


# --------------------------------------------------------------------------
# Bridge to JAX
# --------------------------------------------------------------------------


def to_jax_partition_spec(
    canonical_spec: CanonicalSpec, axis_names: Optional[Sequence[str]] = None
) -> PartitionSpec:
    """The ``jax.sharding.PartitionSpec`` equivalent to a canonical spec.

    A dimension over one mesh axis gets that axis's name, one over several
    axes gets a tuple of names (major first, as in JAX), and None stays None.

    Args:
        canonical_spec: a spec from ``normalize_spec``.
        axis_names: the mesh axis names, or None to use ``axis_0``, ``axis_1``,
            ... (the names xshard gives unnamed mesh axes in its JAX mesh).

    Returns:
        A ``PartitionSpec`` with one entry per tensor dimension.

    Example:
        >>> to_jax_partition_spec(((1,), None, (0, 2)), None)
        P('axis_1', None, ('axis_0', 'axis_2'))
        >>> to_jax_partition_spec(((1,), None), ("data", "model"))
        P('model', None)
    """
    names = None if axis_names is None else tuple(axis_names)
    _check_canonical(canonical_spec, None if names is None else len(names))

    def name(axis: int) -> str:
        return f"axis_{axis}" if names is None else names[axis]

    entries = []
    for entry in canonical_spec:
        if entry is None:
            entries.append(None)
        elif len(entry) == 1:
            entries.append(name(entry[0]))
        else:
            entries.append(tuple(name(axis) for axis in entry))
    return PartitionSpec(*entries)
