"""The process-wide default mesh, used where an API takes ``mesh=None``."""

from __future__ import annotations

from xshard.mesh.mesh import Mesh

__all__ = ["get_global_mesh", "set_global_mesh"]

_global_mesh: Mesh | None = None


def set_global_mesh(mesh: Mesh | None) -> None:
    """Sets the default mesh returned by ``get_global_mesh``.

    Args:
        mesh: the mesh to use by default, or None to clear it.

    Raises:
        TypeError: ``mesh`` is neither a Mesh nor None.

    Example:
        >>> set_global_mesh(get_1d_mesh("fsdp"))
        >>> get_global_mesh().axis_names
        ('fsdp',)
    """
    global _global_mesh
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"set_global_mesh expects an xshard Mesh (or None to clear), got "
            f"{type(mesh).__name__} {mesh!r}. Build one with Mesh(...), "
            "HybridMesh(...) or get_1d_mesh()."
        )
    _global_mesh = mesh


def get_global_mesh() -> Mesh | None:
    """Returns the mesh last passed to ``set_global_mesh`` (the same object).

    Returns:
        The global mesh, or None if none has been set.

    Example:
        >>> mesh = Mesh(range(8), (8,), ("data",))
        >>> set_global_mesh(mesh)
        >>> get_global_mesh() is mesh
        True
    """
    return _global_mesh
