"""Seeing a sharding: which device holds which block of a 1-D or 2-D tensor, drawn with ``rich``.

Each block of the tensor is a cell of a grid, labelled with the devices that hold it (several
devices when the block is replicated over a mesh axis). Given the tensor's shape, cell sizes follow
the real, unpadded extents of the blocks, so uneven shards look uneven; devices whose block lies
entirely in the padding are listed under the grid.

Example:
    >>> xs.mark_sharding(w, mesh, ("data", "model"))   # doctest: +SKIP
    >>> xs.visualize_tensor_sharding(w)                # doctest: +SKIP
    ┌───────┬───────┐
    │ CPU 0 │ CPU 1 │
    ├───────┼───────┤
    │ CPU 2 │ CPU 3 │
    ...
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import torch

from xshard.core import runtime
from xshard.spmd.sharded_tensor import annotation_of, device_tensor, get_sharding_spec
from xshard.spmd.spec import shard_shape

# Background colours of the blocks (rich colour names), with a text colour readable on each.
_PALETTE = (("dodger_blue2", "white"), ("dark_orange", "black"), ("green3", "black"),
            ("medium_purple", "white"), ("gold1", "black"), ("deep_pink3", "white"),
            ("cyan3", "black"), ("indian_red", "white"), ("chartreuse3", "black"),
            ("steel_blue", "white"), ("light_salmon1", "black"), ("orchid", "black"))


@dataclasses.dataclass(frozen=True)
class ParsedSharding:
    """A V1 or V2 HLO sharding string as a tile grid.

    Attributes:
        tile_shape: the number of blocks along each tensor dimension (empty when replicated).
        devices: device ids, shape ``(*tile_shape, replicas)``: the devices holding each block.
        kind: 'tiled', 'replicated', 'maximal' or 'manual'.
    """

    tile_shape: tuple
    devices: np.ndarray
    kind: str


_TILED = re.compile(r"^\{devices=\[([\d,]+)\]([^ }]+)(?: (last_tile_dim_replicate|"
                    r"last_tile_dims=\{[^}]*\}))?\}$")
_IOTA = re.compile(r"^<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def parse_sharding(sharding_string: str, all_devices=None) -> ParsedSharding:
    """Parses ``{devices=[2,4]0,1,...}``, the iota form ``{devices=[2,4]<=[8]}``, ``{replicated}``,
    ``{maximal device=3}`` and ``{manual}``.

    Args:
        sharding_string: an HLO sharding string, e.g. from ``xs.get_sharding_spec``.
        all_devices: the device ids a replicated or manual tensor lives on (default: every
            runtime device).

    Raises:
        ValueError: the string is not an HLO sharding this function understands.
    """
    text = sharding_string.strip()
    if all_devices is None:
        all_devices = list(range(runtime.device_count()))  # mesh device ids are positions
    everyone = np.array(sorted(int(d) for d in all_devices), dtype=np.int64)
    if text in ("", "{replicated}"):
        return ParsedSharding((), everyone.reshape(1, -1), "replicated")
    if text == "{manual}":
        return ParsedSharding((), everyone.reshape(1, -1), "manual")
    maximal = re.match(r"^\{maximal device=(\d+)\}$", text)
    if maximal:
        return ParsedSharding((), np.array([[int(maximal.group(1))]]), "maximal")
    tiled = _TILED.match(text)
    if not tiled:
        raise ValueError(
            f"Cannot read the sharding string {sharding_string!r}; expected an HLO sharding such "
            f"as '{{devices=[2,4]0,1,2,3,4,5,6,7}}', '{{devices=[2,1,4]<=[8] "
            f"last_tile_dim_replicate}}' or '{{replicated}}'.")
    dims = [int(d) for d in tiled.group(1).split(",")]
    ids_text, suffix = tiled.group(2), tiled.group(3)
    iota = _IOTA.match(ids_text)
    if iota:
        reshape = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if iota.group(2):
            ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
        ids = ids.ravel()
    else:
        ids = np.array([int(d) for d in ids_text.split(",")], dtype=np.int64)
    if ids.size != math.prod(dims):
        raise ValueError(f"The sharding string {sharding_string!r} lists {ids.size} devices for a "
                         f"tile assignment of {dims} ({math.prod(dims)} devices).")
    if suffix == "last_tile_dim_replicate":
        tile_shape, replicas = tuple(dims[:-1]), dims[-1]
    elif suffix:  # last_tile_dims={...}: every trailing subgroup dimension holds copies
        count = len(suffix.split("{")[1].rstrip("}").split(","))
        tile_shape, replicas = tuple(dims[:-count]), math.prod(dims[-count:])
    else:
        tile_shape, replicas = tuple(dims), 1
    return ParsedSharding(tile_shape, ids.reshape(*tile_shape, replicas), "tiled")


def _extents(size: int | None, tiles: int) -> list:
    """The real size of each block along one dimension (padding excluded)."""
    if size is None:
        return [1] * tiles
    step = shard_shape((size,), (tiles,))[0]
    return [max(0, min(step, size - i * step)) for i in range(tiles)]


def _spread(total: int, weights: list, minimum: int) -> list:
    """Integer sizes proportional to ``weights`` summing to about ``total``, each >= minimum."""
    whole = sum(weights) or 1
    return [max(minimum, round(total * w / whole)) for w in weights]


def _label(platform: str, devices) -> str:
    return f"{platform} " + ",".join(str(int(d)) for d in devices)


def visualize_sharding(sharding_string: str, shape=None, *, use_color: bool = True,
                       scale: float = 1.0, min_width: int = 9, max_width: int = 80,
                       devices=None, print: bool = True, console=None):
    """Draws which devices hold which block of a 1-D or 2-D tensor sharded as given.

    Args:
        sharding_string: an HLO sharding string (``xs.get_sharding_spec(t)``), V1 or iota form.
        shape: the tensor's shape; with it, block sizes follow the real (unpadded) extents and
            blocks made only of padding are listed below the grid. Without it, blocks are even.
        use_color: colour each block.
        scale: scales the height of the drawing.
        min_width: the narrowest block, in characters.
        max_width: the width of the whole drawing, in characters.
        devices: the device ids of a replicated tensor (default: every device).
        print: print the drawing to ``console`` (a ``rich.console.Console``; a new one by default).

    Returns:
        The ``rich`` renderable (a ``Group``: the grid, then any notes), e.g. for
        ``Console(record=True).print``.

    Raises:
        ValueError: the sharding splits more than two dimensions, or the string is not understood.

    Example:
        >>> xs.visualize_sharding("{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}",
        ...                       (16, 8))  # doctest: +SKIP
    """
    from rich import box
    from rich.align import Align
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text

    parsed = parse_sharding(sharding_string, devices)
    if shape is not None:
        shape = tuple(int(s) for s in shape)
    tile_shape = parsed.tile_shape
    if not tile_shape:  # one block held by every device of the group
        ndim = len(shape) if shape is not None else 1
        tile_shape = (1,) * max(ndim, 1)
    if shape is not None and parsed.tile_shape and len(shape) != len(tile_shape):
        raise ValueError(f"The sharding {sharding_string!r} has {len(tile_shape)} tile dimensions "
                         f"but the shape {shape} has {len(shape)}.")
    if len(tile_shape) > 2:
        raise ValueError(
            f"visualize_sharding draws 1-D and 2-D tensors; {sharding_string!r} has "
            f"{len(tile_shape)} dimensions. Reshape or slice the tensor to at most 2-D first.")
    if shape is not None and len(shape) == 0:
        shape = (1,)
    grid = parsed.devices.reshape(*tile_shape, -1)
    if len(tile_shape) == 1:
        grid = grid.reshape(1, tile_shape[0], -1)
        rows, cols = [1], _extents(shape[0] if shape else None, tile_shape[0])
    else:
        rows = _extents(shape[0] if shape else None, tile_shape[0])
        cols = _extents(shape[1] if shape else None, tile_shape[1])
    platform = runtime.platform().upper()

    live_rows = [i for i, r in enumerate(rows) if r > 0]
    live_cols = [j for j, c in enumerate(cols) if c > 0]
    # Sizes in characters: a terminal cell is about 2.5 times as tall as it is wide, so a square
    # tensor gets a grid 2.5 times as wide as it is high; the shape's aspect ratio stretches it.
    if len(tile_shape) == 1:
        total_height = max(1, round(3 * scale))
        total_width = max_width
    else:
        aspect = 1.0 if shape is None else shape[1] / max(shape[0], 1)
        total_height = max(len(live_rows), round(10 * scale))
        total_width = round(total_height * aspect * 2.5)
    total_width = min(max_width, max(total_width, min_width * len(live_cols)))
    widths = _spread(total_width, [cols[j] for j in live_cols], min_width)
    heights = _spread(total_height, [rows[i] for i in live_rows], 1)

    table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=0, pad_edge=False,
                  expand=False)
    for w in widths:
        table.add_column(width=w, justify="center", no_wrap=False)
    colours = {}
    for i, h in zip(live_rows, heights):
        cells = []
        for j in live_cols:
            held = grid[i, j]
            text = _label(platform, held)
            style = ""
            if use_color:
                key = tuple(int(d) for d in held)
                if key not in colours:
                    colours[key] = _PALETTE[len(colours) % len(_PALETTE)]
                bg, fg = colours[key]
                style = f"{fg} on {bg}"
            cells.append(Align(Text(text, style=style, justify="center"), align="center",
                               vertical="middle", height=max(h, 1), style=style))
        table.add_row(*cells)
    notes = []
    if parsed.kind == "manual":
        notes.append(Text("manual: each device holds its own local value"))
    padding_only = sorted(int(d) for i in range(grid.shape[0]) for j in range(grid.shape[1])
                          if (rows[i] == 0 or cols[j] == 0) for d in grid[i, j])
    if padding_only:
        notes.append(Text(f"only padding on {_label(platform, padding_only)}", no_wrap=True))
    drawing = Group(table, *notes)
    if print:
        (console or Console()).print(drawing)
    return drawing


def visualize_tensor_sharding(t: torch.Tensor, *, use_color: bool = True, scale: float = 1.0,
                              min_width: int = 9, max_width: int = 80, print: bool = True,
                              console=None):
    """Draws which device holds which block of the 1-D or 2-D device tensor ``t``.

    Block sizes follow ``t``'s real extents (uneven shards look uneven); see
    ``visualize_sharding`` for the arguments.

    Returns:
        The ``rich`` renderable.

    Example:
        >>> xs.visualize_tensor_sharding(w, use_color=False)  # doctest: +SKIP
    """
    t = device_tensor(t, "visualize_tensor_sharding")
    annotation = annotation_of(t)
    devices = None
    if annotation is not None:
        devices = [int(d) for d in annotation.mesh.device_ids]
    return visualize_sharding(get_sharding_spec(t) or "{replicated}", tuple(t.shape),
                              use_color=use_color, scale=scale, min_width=min_width,
                              max_width=max_width, devices=devices, print=print, console=console)


__all__ = ["visualize_sharding", "visualize_tensor_sharding", "parse_sharding"]
