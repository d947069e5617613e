"""Device meshes: which devices a program runs on, and how they are arranged.

Public API:

* ``Mesh(device_ids, mesh_shape, axis_names=None)``: devices laid out on an
  n-dimensional grid with optional axis names.
* ``AbstractMesh(mesh_shape, axis_names=None)``: shape and names only, no
  devices (``Mesh.abstract``); a cache key for tracing and sharding rules.
* ``HybridMesh(*, ici_mesh_shape, dcn_mesh_shape=None, axis_names=None)``: a
  Mesh whose outer axis factors run across slices or hosts.
* ``get_1d_mesh(axis_name=None)``: all devices on one axis.
* ``set_global_mesh(mesh)`` / ``get_global_mesh()``: the default mesh.

Module order: ``mesh`` (Mesh, AbstractMesh) <- ``hybrid`` <- ``global_mesh``.
"""

from xshard.mesh.global_mesh import get_global_mesh, set_global_mesh
from xshard.mesh.hybrid import HybridMesh
from xshard.mesh.mesh import AbstractMesh, Mesh, get_1d_mesh

__all__ = [
    "AbstractMesh",
    "HybridMesh",
    "Mesh",
    "get_1d_mesh",
    "get_global_mesh",
    "set_global_mesh",
]
