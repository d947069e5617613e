"""HybridMesh: a mesh whose outer axes run across hosts or slices.

[Note: hybrid device order]
Devices come in *granules*: groups with fast links inside (ICI) and slow
links between (DCN). A granule is a TPU slice (devices sharing a
``slice_index``) or, when devices have no slice index, a process (devices
sharing a ``process_index``).

For ``ici_mesh_shape=I`` and ``dcn_mesh_shape=D`` (same length k), mesh axis
i has size ``D[i] * I[i]``, and the DCN factor is the outer one: moving along
axis i first walks through the devices of one granule, then steps to the next
granule. So collectives over the inner (ICI) factor of an axis stay inside a
granule. The device order is built as:

1. ``prod(D)`` granules of ``prod(I)`` devices each.
2. Each granule's devices are laid out in an I-shaped block by JAX's
   ``mesh_utils.create_device_mesh``, which follows the physical topology (a
   TPU slice's torus); elsewhere it keeps the devices' order (row-major).
3. Granule number ``ravel(d)`` (row-major over D) is block ``d``; the blocks
   are placed side by side, block ``d`` at offset ``d[i] * I[i]`` on axis i,
   giving shape ``(D[0]*I[0], D[1]*I[1], ...)``.

Worked example: 8 devices, granules ``[0..3]`` and ``[4..7]``, ``I=(2, 2)``,
``D=(1, 2)``: the blocks are ``[[0, 1], [2, 3]]`` and ``[[4, 5], [6, 7]]``
placed side by side along axis 1, so the logical mesh is
``[[0, 1, 4, 5], [2, 3, 6, 7]]``.

On a single host with no slices there is one granule. If ``prod(D) > 1`` it
is split into ``prod(D)`` equal contiguous granules, which simulates slices
on one host (e.g. 8 virtual CPU devices as 2 "slices" of 4) so multi-slice
layouts can be tested anywhere.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from xshard.mesh import mesh as _mesh
from xshard.mesh.mesh import AxisName, Mesh, _normalize_shape

__all__ = ["HybridMesh"]


def _device_granules() -> list[list[int]]:
    """Global device IDs grouped by slice (or else process), in group order.

    Device ID i is position i in the runtime's global device list. Groups are
    ordered by their slice/process index, IDs within a group ascending.
    """
    groups: dict[int, list[int]] = {}
    for device_id, device in enumerate(_mesh._runtime_devices()):
        key = getattr(device, "slice_index", None)
        if key is None:
            key = device.process_index
        groups.setdefault(key, []).append(device_id)
    return [groups[key] for key in sorted(groups)]


def _split_single_granule(granule: list[int], n: int) -> list[list[int]]:
    """Splits one host's devices into ``n`` equal contiguous simulated slices."""
    if len(granule) % n:
        raise ValueError(
            f"Cannot split the {len(granule)} devices of a single host into "
            f"prod(dcn_mesh_shape) = {n} equal simulated slices: {len(granule)} "
            f"is not divisible by {n}. Choose a dcn_mesh_shape whose product "
            f"divides {len(granule)}."
        )
    size = len(granule) // n
    return [granule[i * size : (i + 1) * size] for i in range(n)]


def _hybrid_device_ids(
    granules: Sequence[Sequence[int]],
    ici_mesh_shape: tuple[int, ...],
    dcn_mesh_shape: tuple[int, ...],
) -> np.ndarray:
    """The hybrid device order, shaped ``ici * dcn``; see [Note: hybrid device order]."""
    num_granules = math.prod(dcn_mesh_shape)
    granule_size = math.prod(ici_mesh_shape)
    if len(granules) == 1 and num_granules > 1:
        granules = _split_single_granule(list(granules[0]), num_granules)
    if len(granules) != num_granules:
        raise ValueError(
            f"The devices form {len(granules)} slices/processes, but "
            f"prod(dcn_mesh_shape) = prod({dcn_mesh_shape}) = {num_granules}. "
            f"Set dcn_mesh_shape so that its product is {len(granules)}, or "
            "use Mesh for a layout that ignores slice/process boundaries."
        )
    sizes = sorted({len(g) for g in granules})
    if sizes != [granule_size]:
        raise ValueError(
            f"Each slice/process must hold prod(ici_mesh_shape) = "
            f"prod({ici_mesh_shape}) = {granule_size} devices, but they hold "
            f"{sizes}. Set ici_mesh_shape so that its product is the number "
            "of devices per slice/process."
        )
    k = len(ici_mesh_shape)
    blocks = np.stack([_arrange(g, ici_mesh_shape) for g in granules])
    blocks = blocks.reshape(dcn_mesh_shape + ici_mesh_shape)
    interleaved = [axis for i in range(k) for axis in (i, k + i)]
    mesh_shape = tuple(d * i for d, i in zip(dcn_mesh_shape, ici_mesh_shape))
    return blocks.transpose(interleaved).reshape(mesh_shape)


def _arrange(granule: Sequence[int], ici_mesh_shape: tuple[int, ...]) -> np.ndarray:
    """The device IDs of one granule laid out as ``ici_mesh_shape`` by JAX's topology-aware
    ``mesh_utils.create_device_mesh``."""
    from jax.experimental import mesh_utils

    devices = _mesh._runtime_devices()
    chosen = [devices[i] for i in granule]
    arranged = mesh_utils.create_device_mesh(ici_mesh_shape, devices=chosen,
                                             allow_split_physical_axes=True)
    position = {id(d): i for i, d in zip(granule, chosen)}
    return np.vectorize(lambda d: position[id(d)], otypes=[np.int64])(arranged)


class HybridMesh(Mesh):
    """A mesh over all devices whose axes split into ICI (inner) and DCN (outer).

    Mesh axis i has size ``dcn_mesh_shape[i] * ici_mesh_shape[i]``; its DCN
    factor steps across slices (or processes), its ICI factor across the
    devices of one slice. See [Note: hybrid device order] in this module.

    On a single host with ``prod(dcn_mesh_shape) > 1`` the host's devices are
    split into that many equal contiguous groups, simulating slices (e.g. 8
    virtual CPU devices as 2 slices of 4).

    Args:
        ici_mesh_shape: mesh shape within one slice/process; its product is
            the number of devices per slice/process.
        dcn_mesh_shape: mesh shape across slices/processes, same length as
            ``ici_mesh_shape``; its product is the number of slices/processes.
            None means all ones (a single slice).
        axis_names: one unique str per mesh axis, or None.

    Raises:
        TypeError, ValueError: the shapes are malformed, or do not match the
            number of slices/processes and devices.

    Example:
        >>> # 2 hosts with 4 devices each: data parallel across hosts.
        >>> mesh = HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1),
        ...                   axis_names=("data", "model"))
        >>> mesh.mesh_shape
        (2, 4)
    """

    __slots__ = ("ici_mesh_shape", "dcn_mesh_shape")

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]

    def __init__(
        self,
        *,
        ici_mesh_shape: tuple[int, ...],
        dcn_mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[AxisName, ...] | None = None,
    ) -> None:
        ici = _normalize_shape(ici_mesh_shape, "ici_mesh_shape")
        if dcn_mesh_shape is None:
            dcn = (1,) * len(ici)
        else:
            dcn = _normalize_shape(dcn_mesh_shape, "dcn_mesh_shape")
        if len(dcn) != len(ici):
            raise ValueError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the "
                f"same length (one entry per mesh axis), got {len(ici)} and "
                f"{len(dcn)}. Pad the shorter one with 1s."
            )
        logical = _hybrid_device_ids(_device_granules(), ici, dcn)
        super().__init__(logical, logical.shape, axis_names)
        object.__setattr__(self, "ici_mesh_shape", ici)
        object.__setattr__(self, "dcn_mesh_shape", dcn)

    def _state(self) -> dict[str, Any]:
        return {
            **super()._state(),
            "ici_mesh_shape": self.ici_mesh_shape,
            "dcn_mesh_shape": self.dcn_mesh_shape,
        }

    def __repr__(self) -> str:
        # Re-evaluating rebuilds the same order on the same devices, and
        # HybridMesh compares equal to a Mesh with the same layout.
        return (
            f"HybridMesh(ici_mesh_shape={self.ici_mesh_shape!r}, "
            f"dcn_mesh_shape={self.dcn_mesh_shape!r}, "
            f"axis_names={self.axis_names!r})"
        )
