"""visualize_sharding / visualize_tensor_sharding: which device holds which block, drawn by rich."""

import re

import numpy as np
import pytest
import torch
from rich.console import Console

import xshard
import xshard.spmd as xs
from xshard.spmd.debugging import parse_sharding

DEV = xshard.device()


def draw(t_or_string, shape=None, width=120, **kw):
    console = Console(record=True, width=width, color_system=None)
    if isinstance(t_or_string, str):
        xs.visualize_sharding(t_or_string, shape, console=console, **kw)
    else:
        xs.visualize_tensor_sharding(t_or_string, console=console, **kw)
    return console.export_text()


def marked(shape, mesh, spec):
    t = torch.zeros(*shape, device=DEV)
    xs.mark_sharding(t, mesh, spec)
    return t


def rows_of(text):
    """The labels of each row of the grid, and each row's height in lines."""
    rows, current, height = [], [], 0
    for line in text.splitlines():
        if line.startswith(("┌", "├", "└")):
            if height:
                rows.append((current, height))
            current, height = [], 0
        elif line.startswith("│"):
            height += 1
            current += re.findall(r"CPU [\d,]+", line)
    return rows


def column_widths(text):
    top = next(line for line in text.splitlines() if line.startswith("┌"))
    return [len(part) for part in top.strip("┌┐").split("┬")]


@pytest.fixture(scope="module")
def mesh():
    return xs.Mesh(np.arange(8), (4, 2), ("data", "model"))


def test_tiled_2d(mesh):
    text = draw(marked((8, 8), mesh, ("data", "model")), use_color=False)
    assert [labels for labels, _ in rows_of(text)] == [
        ["CPU 0", "CPU 1"], ["CPU 2", "CPU 3"], ["CPU 4", "CPU 5"], ["CPU 6", "CPU 7"]]
    # Specs ordered differently from the mesh transpose the grid.
    text = draw(marked((8, 8), mesh, ("model", "data")), use_color=False)
    assert [labels for labels, _ in rows_of(text)] == [
        ["CPU 0", "CPU 2", "CPU 4", "CPU 6"], ["CPU 1", "CPU 3", "CPU 5", "CPU 7"]]


def test_partial_replication_lists_every_holder(mesh):
    text = draw(marked((8, 8), mesh, ("model", None)), use_color=False)
    assert [labels for labels, _ in rows_of(text)] == [["CPU 0,2,4,6"], ["CPU 1,3,5,7"]]
    text = draw(marked((8,), mesh, ("data",)), use_color=False)
    assert [labels for labels, _ in rows_of(text)] == [["CPU 0,1", "CPU 2,3", "CPU 4,5", "CPU 6,7"]]


def test_replicated_is_one_block(mesh):
    text = draw(marked((4, 4), mesh, (None, None)), use_color=False)
    assert [labels for labels, _ in rows_of(text)] == [["CPU 0,1,2,3,4,5,6,7"]]
    text = draw(torch.zeros(4, 4, device=DEV), use_color=False)  # unannotated: replicated
    assert [labels for labels, _ in rows_of(text)] == [["CPU 0,1,2,3,4,5,6,7"]]


def test_uneven_blocks_follow_the_real_extents():
    mesh = xs.Mesh(np.arange(8), (8,), ("d",))
    # 9 rows over 8 devices: blocks of 2 rows, the fifth has 1, the last three only padding.
    text = draw(marked((9, 4), mesh, ("d", None)), use_color=False)
    rows = rows_of(text)
    assert [labels for labels, _ in rows] == [[f"CPU {i}"] for i in range(5)]
    heights = [h for _, h in rows]
    assert heights[:4] == [heights[0]] * 4 and heights[4] < heights[0]
    assert "only padding on CPU 5,6,7" in text
    # The same along columns of a 1-D tensor.
    text = draw(marked((9,), mesh, ("d",)), use_color=False)
    widths = column_widths(text)
    assert len(widths) == 5 and widths[4] < widths[0] == widths[3]
    assert "only padding on CPU 5,6,7" in text


def test_sharding_strings_v1_and_iota_draw_the_same():
    v1 = "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    iota = "{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}"
    assert draw(v1, use_color=False) == draw(iota, use_color=False)
    assert [labels for labels, _ in rows_of(draw(v1, (8, 8), use_color=False))] == [
        ["CPU 0,4", "CPU 1,5", "CPU 2,6", "CPU 3,7"]]
    parsed = parse_sharding("{devices=[2,2]3,2,1,0}")
    assert parsed.tile_shape == (2, 2) and parsed.devices.ravel().tolist() == [3, 2, 1, 0]


def test_color_and_return_value(mesh, capsys):
    t = marked((8, 8), mesh, ("data", "model"))
    table = xs.visualize_tensor_sharding(t, print=False)
    assert capsys.readouterr().out == ""
    console = Console(record=True, width=120, force_terminal=True, color_system="truecolor")
    console.print(table)
    styled = console.export_text(styles=True)
    assert "\x1b[" in styled and "CPU 7" in styled
    xs.visualize_tensor_sharding(t, use_color=False)  # prints by default
    assert "CPU 7" in capsys.readouterr().out


def test_errors(mesh):
    with pytest.raises(ValueError, match="draws 1-D and 2-D tensors"):
        xs.visualize_tensor_sharding(marked((2, 2, 2), mesh, ("data", None, "model")), print=False)
    with pytest.raises(ValueError, match="Cannot read the sharding string 'garbage'"):
        xs.visualize_sharding("garbage", print=False)
    with pytest.raises(TypeError, match="needs a tensor on the xshard device"):
        xs.visualize_tensor_sharding(torch.zeros(2))
