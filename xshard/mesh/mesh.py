"""The device mesh: an n-dimensional array of device IDs with named axes.

A mesh has two parts, kept apart on purpose:

* ``AbstractMesh``: the shape and the axis names. It needs no devices, so
  tracing, sharding rules and cache keys can use it before any device exists.
* ``Mesh``: an ``AbstractMesh`` plus the device IDs laid out on it.

Both are small immutable values, validated on construction, compared and
hashed by value, with a repr that can be pasted back into Python.

A device ID is the position of a device in ``xshard.core.runtime.devices()``
(the global device list, sorted by id), so IDs run over ``0..N-1`` where N is
the global device count. Unlike torch_xla, a mesh may use a subset of the
devices ("local SPMD", pytorch/xla #9181).

This module reaches the runtime only through the small helpers
``_global_device_count`` and ``_runtime_devices``, imported lazily, so
``xshard.mesh`` can be imported (and tested, by patching those helpers)
without ``xshard.core``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence, Union

import numpy as np

if TYPE_CHECKING:
    import jax

__all__ = ["AbstractMesh", "Mesh", "get_1d_mesh"]

DeviceIds = Union[Sequence[int], range, np.ndarray]
AxisName = str


# --------------------------------------------------------------------------
# Runtime access (lazy, and the only place this package touches xshard.core)
# --------------------------------------------------------------------------


def _global_device_count() -> int:
    """Number of devices over all processes, from the runtime."""
    from xshard.core import runtime

    return runtime.device_count()


def _runtime_devices() -> list:
    """The global list of jax devices, sorted by id; device ID i is entry i."""
    from xshard.core import runtime

    return list(runtime.devices())


# --------------------------------------------------------------------------
# Normalisation and validation of user input
# --------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a mesh size or device ID is a bug.
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _normalize_shape(shape: Any, arg_name: str = "mesh_shape") -> tuple[int, ...]:
    """Returns ``shape`` as a non-empty tuple of positive Python ints."""
    if not isinstance(shape, (tuple, list)):
        hint = f" Use ({shape!r},) for a 1-D mesh." if _is_int(shape) else ""
        raise TypeError(
            f"{arg_name} must be a tuple of positive ints, got "
            f"{type(shape).__name__} {shape!r}.{hint}"
        )
    if len(shape) == 0:
        raise ValueError(
            f"{arg_name} must have at least one axis, got (). "
            "Use (1,) for a mesh over a single device."
        )
    for i, size in enumerate(shape):
        if not _is_int(size):
            raise TypeError(
                f"{arg_name} entries must be positive ints, got {size!r} "
                f"({type(size).__name__}) at index {i} of {tuple(shape)!r}."
            )
        if size <= 0:
            raise ValueError(
                f"{arg_name} entries must be positive ints, got {size!r} at "
                f"index {i} of {tuple(shape)!r}. Every mesh axis needs at "
                "least one device; use 1 for an axis that does not split."
            )
    return tuple(int(size) for size in shape)


def _normalize_axis_names(
    axis_names: Any, ndim: int
) -> tuple[AxisName, ...] | None:
    """Returns ``axis_names`` as a tuple of unique strings (or None)."""
    if axis_names is None:
        return None
    if isinstance(axis_names, str):
        raise TypeError(
            f"axis_names must be a tuple of str, got the str {axis_names!r}. "
            f"Use ({axis_names!r},) for a single axis."
        )
    if not isinstance(axis_names, (tuple, list)):
        raise TypeError(
            "axis_names must be a tuple of str or None, got "
            f"{type(axis_names).__name__} {axis_names!r}."
        )
    for name in axis_names:
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"axis_names entries must be non-empty strs, got {name!r} in "
                f"{tuple(axis_names)!r}."
            )
    names = tuple(axis_names)
    if len(names) != ndim:
        raise ValueError(
            f"Number of axis names ({len(names)}) must match the number of "
            f"mesh dimensions ({ndim}): got axis_names={names!r}. Give one "
            "name per mesh axis, or axis_names=None."
        )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Axis names must be unique, but {duplicates!r} appear more than "
            f"once in {names!r}. Rename the repeated axes."
        )
    return names


def _normalize_device_ids(device_ids: Any) -> np.ndarray:
    """Returns ``device_ids`` flattened to a fresh, read-only 1-D int64 array.

    Only types and shape are checked here; range and uniqueness are checked in
    ``Mesh.__init__`` once the count is known to match the mesh.
    """
    if not isinstance(device_ids, (list, tuple, range, np.ndarray)):
        raise TypeError(
            "device_ids must be a list, tuple, range or numpy array of ints, "
            f"got {type(device_ids).__name__} {device_ids!r}. For example "
            "device_ids=list(range(8))."
        )
    try:
        array = np.array(device_ids)  # Always a copy: callers may mutate theirs.
    except ValueError as e:  # Ragged nesting, e.g. [[0, 1], [2]].
        raise ValueError(
            "device_ids must be a flat or rectangular nested sequence of ints, "
            f"got {device_ids!r} ({e})."
        ) from None
    if array.size and array.dtype.kind not in "iu":
        flat = array.ravel().tolist()
        bad = [v for v in flat if not _is_int(v)]
        raise TypeError(
            f"device_ids must contain only ints, got {bad[:5]!r} in "
            f"{device_ids!r}. Pass integer device IDs such as list(range(8))."
        )
    array = array.astype(np.int64).reshape(-1)
    array.flags.writeable = False
    return array


# --------------------------------------------------------------------------
# AbstractMesh
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AbstractMesh:
    """The shape and axis names of a mesh, with no devices.

    Use it where only the layout matters: as a cache key, or when reasoning
    about a partition spec before devices are known. Frozen and hashable.

    Args:
        mesh_shape: size of each mesh axis, e.g. ``(4, 2)``.
        axis_names: one unique name per axis, or None for unnamed axes.

    Example:
        >>> AbstractMesh((4, 2), ("data", "model")).shape()
        OrderedDict([('data', 4), ('model', 2)])
    """

    mesh_shape: tuple[int, ...]
    axis_names: tuple[AxisName, ...] | None = None

    def __post_init__(self) -> None:
        shape = _normalize_shape(self.mesh_shape)
        names = _normalize_axis_names(self.axis_names, len(shape))
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "axis_names", names)

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.mesh_shape)

    def size(self) -> int:
        """Number of devices in the mesh: the product of ``mesh_shape``."""
        return math.prod(self.mesh_shape)

    def shape(self) -> collections.OrderedDict:
        """Axis name (or index, when unnamed) -> axis size, in axis order."""
        keys = self.axis_names if self.axis_names is not None else range(self.ndim)
        return collections.OrderedDict(zip(keys, self.mesh_shape))

    def get_axis_name_idx(self, name: AxisName) -> int | None:
        """Index of the axis called ``name``, or None if there is none."""
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def axis_index(self, axis: int | AxisName) -> int:
        """Resolves a mesh axis given by index or by name to its index.

        Args:
            axis: an int in ``0..ndim-1`` or one of ``axis_names``.

        Returns:
            The axis index.

        Raises:
            ValueError: the axis is out of range or not a name of this mesh.
            TypeError: ``axis`` is neither an int nor a str.

        Example:
            >>> AbstractMesh((4, 2), ("data", "model")).axis_index("model")
            1
        """
        if isinstance(axis, str):
            if self.axis_names is None:
                raise ValueError(
                    f"Axis name {axis!r} is not defined in the given mesh: "
                    f"the mesh of shape {self.mesh_shape} has no axis names. "
                    f"Refer to its axes by index 0..{self.ndim - 1}, or build "
                    "the mesh with axis_names."
                )
            if axis not in self.axis_names:
                raise ValueError(
                    f"Axis name {axis!r} is not defined in the given mesh: "
                    f"the mesh axes are {self.axis_names!r}. Use one of these "
                    f"names or an index in 0..{self.ndim - 1}."
                )
            return self.axis_names.index(axis)
        if _is_int(axis):
            if not 0 <= axis < self.ndim:
                names = f" {self.axis_names!r}" if self.axis_names else ""
                raise ValueError(
                    f"Mesh axis index {axis} is out of range for the mesh of "
                    f"shape {self.mesh_shape}{names}: valid indices are "
                    f"0..{self.ndim - 1}."
                )
            return int(axis)
        raise TypeError(
            f"A mesh axis must be an int index or a str name, got "
            f"{type(axis).__name__} {axis!r}."
        )


# --------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------


def _unpickle_mesh(cls: type, state: dict) -> "Mesh":
    # Restores the exact value without re-querying the runtime (HybridMesh
    # would otherwise recompute its device order on the unpickling host).
    mesh = object.__new__(cls)
    for name, value in state.items():
        object.__setattr__(mesh, name, value)
    mesh._finish_init()
    return mesh


class Mesh:
    """A logical n-dimensional array of devices, with optional axis names.

    ``device_ids`` are laid out row-major over ``mesh_shape``. The mesh may
    use any subset of the devices, but each ID must be in ``0..N-1`` where N
    is the global device count, and appear once.

    A Mesh is immutable and compares and hashes by value (device IDs, shape,
    axis names), so it can be a cache key. Its repr evaluates back to an
    equal Mesh.

    Args:
        device_ids: the device IDs, as a list, tuple, range or numpy array of
            ints of any shape; it is flattened row-major.
        mesh_shape: size of each mesh axis; its product must equal the number
            of device IDs.
        axis_names: one unique str per mesh axis, or None.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: the IDs don't fit the shape, repeat, or are out of range;
            the names don't match the shape or repeat.

    Example:
        >>> mesh = Mesh(range(8), (4, 2), ("data", "model"))
        >>> mesh.get_logical_mesh()
        array([[0, 1],
               [2, 3],
               [4, 5],
               [6, 7]])
        >>> mesh.shape()["model"]
        2
    """

    __slots__ = ("device_ids", "abstract", "_key", "_hash", "_jax_mesh")

    device_ids: np.ndarray
    abstract: AbstractMesh

    def __init__(
        self,
        device_ids: DeviceIds,
        mesh_shape: tuple[int, ...],
        axis_names: tuple[AxisName, ...] | None = None,
    ) -> None:
        ids = _normalize_device_ids(device_ids)
        abstract = AbstractMesh(mesh_shape, axis_names)
        _check_device_ids(ids, abstract.mesh_shape)
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "abstract", abstract)
        self._finish_init()

    def _finish_init(self) -> None:
        # Unpickled arrays come back writeable; a mesh's never are.
        self.device_ids.flags.writeable = False
        # The value used for ==, computed once (the ids never change).
        key = (tuple(self.device_ids.tolist()), self.mesh_shape, self.axis_names)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "_jax_mesh", None)

    # -- Immutability --------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} is immutable: cannot set {name!r}. "
            "Build a new mesh instead."
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(
            f"{type(self).__name__} is immutable: cannot delete {name!r}."
        )

    def __copy__(self) -> "Mesh":
        return self

    def __deepcopy__(self, memo: dict) -> "Mesh":
        return self

    def _state(self) -> dict:
        return {"device_ids": self.device_ids, "abstract": self.abstract}

    def __reduce__(self):
        return (_unpickle_mesh, (type(self), self._state()))

    # -- Value semantics -----------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (
            f"Mesh(device_ids={self.device_ids.tolist()!r}, "
            f"mesh_shape={self.mesh_shape!r}, axis_names={self.axis_names!r})"
        )

    # -- Layout --------------------------------------------------------------

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Size of each mesh axis."""
        return self.abstract.mesh_shape

    @property
    def axis_names(self) -> tuple[AxisName, ...] | None:
        """Name of each mesh axis, or None when the axes are unnamed."""
        return self.abstract.axis_names

    @property
    def ndim(self) -> int:
        """Number of mesh axes."""
        return self.abstract.ndim

    def size(self) -> int:
        """Number of devices in the mesh: the product of ``mesh_shape``."""
        return self.abstract.size()

    def shape(self) -> collections.OrderedDict:
        """Axis name (or index, when unnamed) -> axis size, in axis order.

        Example:
            >>> Mesh(range(8), (4, 2)).shape()
            OrderedDict([(0, 4), (1, 2)])
        """
        return self.abstract.shape()

    def get_logical_mesh(self) -> np.ndarray:
        """The device IDs reshaped row-major to ``mesh_shape`` (read-only).

        Example:
            >>> Mesh([3, 2, 1, 0], (2, 2)).get_logical_mesh()
            array([[3, 2],
                   [1, 0]])
        """
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name: AxisName) -> int | None:
        """Index of the axis called ``name``, or None if there is none."""
        return self.abstract.get_axis_name_idx(name)

    def axis_index(self, axis: int | AxisName) -> int:
        """Resolves a mesh axis given by index or by name to its index.

        Args:
            axis: an int in ``0..ndim-1`` or one of ``axis_names``.

        Returns:
            The axis index.

        Raises:
            ValueError: naming the mesh axes, when ``axis`` is unknown or out
                of range.

        Example:
            >>> Mesh(range(8), (4, 2), ("data", "model")).axis_index("data")
            0
        """
        return self.abstract.axis_index(axis)

    def get_jax_mesh(self) -> "jax.sharding.Mesh":
        """This mesh as a ``jax.sharding.Mesh`` over the runtime's devices.

        Device ID i is ``xshard.core.runtime.devices()[i]``. Unnamed axes are
        called ``axis_0, axis_1, ...``. The result is cached on the mesh.

        Returns:
            A ``jax.sharding.Mesh`` with the same shape and device layout.

        Example:
            >>> Mesh([0], (1,)).get_jax_mesh().shape
            OrderedDict([('axis_0', 1)])
        """
        if self._jax_mesh is None:
            import jax

            devices = _runtime_devices()
            device_array = np.empty(self.size(), dtype=object)
            device_array[:] = [devices[i] for i in self.device_ids.tolist()]
            names = self.axis_names or tuple(f"axis_{i}" for i in range(self.ndim))
            jax_mesh = jax.sharding.Mesh(device_array.reshape(self.mesh_shape), names)
            object.__setattr__(self, "_jax_mesh", jax_mesh)
        return self._jax_mesh


def _check_device_ids(ids: np.ndarray, mesh_shape: tuple[int, ...]) -> None:
    """Raises ValueError unless ``ids`` fill ``mesh_shape`` with valid IDs."""
    size = math.prod(mesh_shape)
    if ids.size != size:
        raise ValueError(
            f"Number of device IDs ({ids.size}) must match the mesh size "
            f"{size} = prod({mesh_shape}). Pass {size} device IDs, or choose "
            f"a mesh_shape whose product is {ids.size}."
        )
    values, counts = np.unique(ids, return_counts=True)
    duplicates = values[counts > 1].tolist()
    if duplicates:
        raise ValueError(
            f"Device IDs must be unique, but {duplicates} appear more than "
            "once. Use each device at most once in a mesh."
        )
    count = _global_device_count()
    bad = sorted(set(ids[(ids < 0) | (ids >= count)].tolist()))
    if bad:
        raise ValueError(
            f"Device IDs {bad} are out of range: valid device IDs are "
            f"0..{count - 1} (the global device count is {count}). Use IDs "
            f"from range({count})."
        )


def get_1d_mesh(axis_name: AxisName | None = None) -> Mesh:
    """A 1-D mesh over all devices, in ID order: shape ``(N,)``.

    Args:
        axis_name: name of the single axis, or None for an unnamed axis.

    Returns:
        ``Mesh(range(N), (N,), (axis_name,))`` where N is the global device
        count.

    Example:
        >>> get_1d_mesh("data")  # on 4 devices
        Mesh(device_ids=[0, 1, 2, 3], mesh_shape=(4,), axis_names=('data',))
    """
    count = _global_device_count()
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(
            f"axis_name must be a str or None, got "
            f"{type(axis_name).__name__} {axis_name!r}."
        )
    names = None if axis_name is None else (axis_name,)
    return Mesh(range(count), (count,), names)
