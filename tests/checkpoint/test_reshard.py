"""Tensors saved in one layout load bit-exactly into another: meshes, specs, uneven shapes, dtypes;
each block is written once, and a load reads only the saved chunks overlapping its blocks."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import xshard.checkpoint as xcp
from xshard.checkpoint import layout
from xshard.core import api

from tests.checkpoint.checkpoint_testing import DEV, assert_same, mesh, on_device, shard_shapes, \
    spec_of

torch.manual_seed(0)
VALUES = {
    "uneven": torch.randn(9, 5),                 # 9 rows over 8 devices: padded, 3 empty blocks
    "bf16": torch.randn(16, 6).bfloat16(),
    "ints": torch.arange(24).reshape(4, 6),
    "flags": torch.rand(6) > 0.5,
    "scalar": torch.tensor(3.25),
    "empty": torch.zeros(0, 4),
}

# name -> (mesh shape, axis names, spec per key); keys without a spec stay unannotated (replicated).
LAYOUTS = {
    "rows8": ((8,), ("x",), {"uneven": ("x", None), "bf16": ("x", None), "ints": (None, "x"),
                             "flags": ("x",)}),
    "grid2x4": ((2, 4), ("a", "b"), {"uneven": ("b", "a"), "bf16": (None, "b"),
                                     "ints": ("a", "b"), "flags": ("a",)}),
    "grid4x2": ((4, 2), ("data", "model"), {"uneven": (None, "data"), "bf16": ("model", "data"),
                                            "ints": ("data", None), "empty": ("data", None)}),
    "replicated": ((8,), ("x",), {}),
}


def build(layout_name: str, values: dict) -> dict:
    shape, names, specs = LAYOUTS[layout_name]
    m = mesh(shape, names)
    return {k: on_device(v, m if k in specs else None, specs.get(k)) for k, v in values.items()}


def zeros_like(values: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in values.items()}


@pytest.mark.parametrize("saved, loaded", [("rows8", "grid2x4"), ("grid2x4", "grid4x2"),
                                           ("grid4x2", "replicated"), ("replicated", "rows8")])
def test_round_trip_into_another_layout(tmp_path, saved, loaded):
    xcp.save({"t": build(saved, VALUES)}, tmp_path / "ckpt")
    target = build(loaded, zeros_like(VALUES))
    specs = {k: spec_of(v) for k, v in target.items()}
    shapes = {k: shard_shapes(v) for k, v in target.items()}
    xcp.load({"t": target}, tmp_path / "ckpt")
    assert_same(target, VALUES)
    # Laid out as the target was, not as saved.
    assert {k: spec_of(v) for k, v in target.items()} == specs
    assert {k: shard_shapes(v) for k, v in target.items()} == shapes


def test_load_into_cpu_tensors_and_the_reverse(tmp_path):
    xcp.save({"t": build("grid2x4", VALUES)}, tmp_path / "a")
    cpu = zeros_like(VALUES)
    xcp.load({"t": cpu}, tmp_path / "a")
    assert_same(cpu, VALUES)
    xcp.save({"t": dict(VALUES)}, tmp_path / "b")
    target = build("rows8", zeros_like(VALUES))
    xcp.load({"t": target}, tmp_path / "b")
    assert_same(target, VALUES)


def test_cpu_tensors_of_dtypes_devices_lack(tmp_path):
    """A CPU tensor of a dtype xshard devices do not hold loads as it saved (it was refused:
    'not supported on xshard devices')."""
    values = {"fnuz": torch.randn(4, 3).to(torch.float8_e4m3fnuz),
              "complex32": torch.randn(5, dtype=torch.complex64).to(torch.complex32)}
    xcp.save({"t": values}, tmp_path / "c")
    target = {k: torch.zeros_like(v) for k, v in values.items()}
    xcp.load({"t": target}, tmp_path / "c")
    for key, value in values.items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key


def test_load_keeps_tensor_identity_and_storage(tmp_path):
    m = mesh((4, 2), ("data", "model"))
    w = on_device(torch.randn(8, 4), m, ("data", "model"))
    xcp.save({"w": w}, tmp_path / "c")
    param = torch.nn.Parameter(on_device(torch.zeros(8, 4), m, ("model", None)))
    view_of_param = param.detach()
    state = {"w": param.detach()}
    xcp.load(state, tmp_path / "c")
    assert api.storage(state["w"]) is api.storage(param)
    assert torch.equal(param.detach().cpu(), w.cpu()) and torch.equal(view_of_param.cpu(), w.cpu())
    assert param.requires_grad and spec_of(param) == "{devices=[2,1,4]0,2,4,6,1,3,5,7 " \
                                                     "last_tile_dim_replicate}"


def chunks(path, key):
    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata[key]
    assert isinstance(md, TensorStorageMetadata)
    return [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]


def test_each_block_is_written_once(tmp_path):
    grid = mesh((2, 4), ("a", "b"))
    state = {
        # split 4 ways over b, each block held by 2 devices (a): 4 blocks written, not 8
        "partial": on_device(torch.randn(8, 12), grid, (None, "b")),
        # one replica per device, written once
        "replicated": on_device(torch.randn(5, 3)),
        # 9 rows in blocks of 2: devices 5-7 hold padding only and write nothing
        "uneven": on_device(torch.randn(9, 5), mesh(), ("x", None)),
    }
    xcp.save(state, tmp_path / "ckpt")
    assert sorted(chunks(tmp_path / "ckpt", "partial")) == [((0, c), (8, 3)) for c in (0, 3, 6, 9)]
    assert chunks(tmp_path / "ckpt", "replicated") == [((0, 0), (5, 3))]
    assert sorted(chunks(tmp_path / "ckpt", "uneven")) == \
        [((r, 0), (min(2, 9 - r), 5)) for r in (0, 2, 4, 6, 8)]
    data_files = [f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".distcp")]
    assert data_files == ["__0_0.distcp"]
    # The file holds those 10 items and nothing else.
    storage = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().storage_data
    assert len(storage) == 10
    assert sum(s.length for s in storage.values()) == \
        os.path.getsize(tmp_path / "ckpt" / data_files[0])


def test_load_reads_only_overlapping_chunks(tmp_path):
    rows = mesh((8,), ("x",))
    xcp.save({"w": on_device(torch.randn(16, 4), rows, ("x", None))}, tmp_path / "ckpt")
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()

    def reads(target):
        planner = xcp.LoadPlanner()
        planner.set_up_planner({"w": target}, metadata, True)
        return planner.create_local_plan().items

    # Same layout: each device's block reads exactly its own saved chunk.
    same = reads(on_device(torch.zeros(16, 4), rows, ("x", None)))
    assert sorted((tuple(r.storage_index.offset), tuple(r.dest_offsets), tuple(r.lengths))
                  for r in same) == [((2 * i, 0), (0, 0), (2, 4)) for i in range(8)]
    # Two distinct blocks, each held by 4 devices: each block is filled once from the 4 chunks
    # that overlap it, and every saved chunk is read once.
    halves = reads(on_device(torch.zeros(16, 4), mesh((2, 4), ("a", "b")), ("a", None)))
    by_block = {}
    for r in halves:
        by_block.setdefault(tuple(r.dest_index.offset), []).append(tuple(r.storage_index.offset))
    assert {k: sorted(v) for k, v in by_block.items()} == {
        (0, 0): [(0, 0), (2, 0), (4, 0), (6, 0)], (8, 0): [(8, 0), (10, 0), (12, 0), (14, 0)]}
    # Columns split 8 ways: 4 columns, so devices 4-7 hold padding only and read nothing; each
    # one-column block reads the 8 saved row chunks, one column of each.
    columns = reads(on_device(torch.zeros(16, 4), rows, (None, "x")))
    assert len(columns) == 32
    assert {tuple(r.dest_index.offset) for r in columns} == {(0, c) for c in range(4)}
    assert {tuple(r.lengths) for r in columns} == {(2, 1)}


def test_python_values_and_nesting(tmp_path):
    saved = {"step": 7, "lr": 0.125, "name": "run-3", "betas": (0.9, 0.95), "flag": True,
             "nested": {"ids": [1, 2, 3], "deep": {"t": on_device(torch.arange(6.0)), "n": None}},
             "by_int": {0: "zero", 1: None}}
    xcp.save(saved, tmp_path / "ckpt")
    state = {"step": 0, "lr": 0.0, "name": "", "betas": (0.0, 0.0), "flag": False,
             "nested": {"ids": [], "deep": {"t": on_device(torch.zeros(6)), "n": 1}},
             "by_int": {0: "", 1: 5}}
    nested, deep = state["nested"], state["nested"]["deep"]
    xcp.load(state, tmp_path / "ckpt")
    assert state["nested"] is nested and state["nested"]["deep"] is deep
    assert_same(state, {"step": 7, "lr": 0.125, "name": "run-3", "betas": (0.9, 0.95),
                        "flag": True, "nested": {"ids": [1, 2, 3],
                                                 "deep": {"t": torch.arange(6.0), "n": None}},
                        "by_int": {0: "zero", 1: None}})


def test_subset_of_top_level_keys(tmp_path):
    xcp.save({"a": on_device(torch.ones(4)), "b": on_device(torch.full((3,), 2.0))},
             tmp_path / "ckpt")
    state = {"b": on_device(torch.zeros(3))}
    xcp.load(state, tmp_path / "ckpt")
    assert torch.equal(state["b"].cpu(), torch.full((3,), 2.0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_and_load_with_the_planners(tmp_path):
    values = {"w": torch.randn(8, 12), "step": 3}
    grid = mesh((2, 4), ("a", "b"))
    dcp.save({"w": on_device(values["w"], grid, (None, "b")), "step": 3},
             checkpoint_id=str(tmp_path / "ckpt"), planner=xcp.SavePlanner())
    target = {"w": on_device(torch.zeros(8, 12), grid, ("a", None)), "step": 0}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), planner=xcp.LoadPlanner())
    assert_same(target, values)
    # PyTorch's default planner reads the same files into CPU tensors.
    cpu = {"w": torch.zeros(8, 12), "step": 0}
    dcp.load(cpu, checkpoint_id=str(tmp_path / "ckpt"))
    assert_same(cpu, values)


def test_blocks_geometry():
    b = layout.block(((8, 10), (0, 5)), (9, 5))
    assert tuple(b.chunk.offsets) == (8, 0) and tuple(b.chunk.sizes) == (1, 5)
    assert b.shape == (2, 5) and b.numel == 5 and b.inside == (slice(0, 1), slice(0, 5))
    padding = layout.block(((10, 12), (0, 5)), (9, 5))
    assert tuple(padding.chunk.sizes) == (0, 5) and padding.numel == 0
    array, view = layout.host_buffer((2, 3), torch.bfloat16)
    view.fill_(1.5)
    assert array.dtype.name == "bfloat16" and float(array[1, 2]) == 1.5
    assert DEV.type == "xshard"


def test_reachable_from_the_package():
    import xshard

    assert xshard.checkpoint.save is xcp.save and xshard.checkpoint.LoadPlanner is xcp.LoadPlanner
