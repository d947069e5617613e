"""A sharding annotation: a mesh plus a canonical partition spec, as core and JAX consume it.

``Annotation`` is the opaque value that ``xshard.core`` stores on a tensor's cell: core only reads
``jax_sharding`` and ``padded_shape``. Everything else (the HLO string, the sharding type, shard
geometry) comes from the device-free plan in ``spec.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from xshard.mesh import Mesh
from xshard.spmd import spec as specs
from xshard.spmd.spec import ShardingType


@dataclasses.dataclass(frozen=True)
class Annotation:
    """How one tensor (of rank ``ndim``) is split over ``mesh``; hashable, compares by value."""

    mesh: Mesh
    spec: specs.CanonicalSpec
    manual: bool = False

    @functools.cached_property
    def plan(self) -> specs.ShardingPlan:
        return specs.plan_sharding(tuple(self.mesh.device_ids.tolist()), self.mesh.mesh_shape,
                                   self.spec)

    @functools.cached_property
    def partition_spec(self):
        return specs.to_jax_partition_spec(self.spec, self.mesh.axis_names)

    @functools.cached_property
    def jax_sharding(self):
        import jax

        return jax.sharding.NamedSharding(self.mesh.get_jax_mesh(), self.partition_spec)

    @property
    def hlo_sharding(self) -> str:
        return "{manual}" if self.manual else self.plan.hlo_sharding

    @property
    def sharding_type(self) -> ShardingType:
        return ShardingType.MANUAL if self.manual else self.plan.sharding_type

    def padded_shape(self, shape) -> tuple:
        return specs.padded_shape(tuple(shape), self.plan.tile_shape)

    def shard_shape(self, shape) -> tuple:
        return specs.shard_shape(tuple(shape), self.plan.tile_shape)


def annotation(mesh: Mesh, partition_spec, ndim: int) -> Annotation:
    """Validates ``partition_spec`` for a rank-``ndim`` tensor on ``mesh`` (raises ValueError)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be an xshard.spmd.Mesh, got {type(mesh).__name__}; build one with "
            f"xs.Mesh(device_ids, mesh_shape, axis_names).")
    canonical = specs.normalize_spec(partition_spec, ndim, mesh.mesh_shape, mesh.axis_names)
    return Annotation(mesh, canonical)


def hlo_string_of_jax_sharding(sharding, ndim: int) -> str:
    """PyTorch/XLA's explicit HLO sharding string for a jax Sharding, naming devices by their
    position in ``xshard.devices()`` (the mesh device ids), not by JAX's ids (which, in a
    multi-process run, are 2048, 2049... for process 1's devices on CPU)."""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    if hlo.is_replicated() or ndim == 0:
        return "{replicated}"
    if hlo.is_manual():
        return "{manual}"
    dims = list(hlo.tile_assignment_dimensions())
    positions = list(hlo.tile_assignment_devices())
    device_list = sharding._device_assignment
    from xshard.core import runtime

    ids = np.array([runtime.position(device_list[p]) for p in positions], dtype=np.int64)
    replicate = hlo.replicate_on_last_tile_dim()
    tile_shape = tuple(dims[:-1]) if replicate else tuple(dims)
    factor = dims[-1] if replicate else 1
    if len(tile_shape) > ndim:  # other subgroup kinds: fold into replication
        factor *= int(np.prod(tile_shape[ndim:]))
        tile_shape = tile_shape[:ndim]
    ids = np.sort(ids.reshape(-1, factor), axis=-1).ravel()
    return specs._hlo_sharding_string(tile_shape, factor, [int(i) for i in ids])


def type_of_hlo_string(text: str) -> ShardingType | None:
    if not text:
        return None
    if text == "{replicated}":
        return ShardingType.REPLICATED
    if text == "{manual}":
        return ShardingType.MANUAL
    if text.startswith("{maximal"):
        return ShardingType.MAXIMAL
    if "last_tile_dim_replicate" in text:
        return ShardingType.PARTIAL
    return ShardingType.TILED
