"""Tests for xshard.mesh: Mesh, AbstractMesh, HybridMesh and the global mesh.

The autouse fixture in conftest.py fakes a single host with 8 devices.
"""

import copy
import dataclasses
import itertools
import math
import pathlib
import pickle
import sys
import types
from collections import OrderedDict

import numpy as np
import pytest

import xshard.mesh.hybrid
import xshard.mesh.mesh
from xshard.mesh import (
    AbstractMesh,
    HybridMesh,
    Mesh,
    get_1d_mesh,
    get_global_mesh,
    set_global_mesh,
)

# Taken at import, before the autouse fixture replaces it.
from xshard.mesh.hybrid import _device_granules as real_device_granules


def use_granules(monkeypatch, granules):
    monkeypatch.setattr(xshard.mesh.hybrid, "_device_granules", lambda: granules)


# --------------------------------------------------------------------------
# Construction and layout
# --------------------------------------------------------------------------


def test_attributes_are_normalised():
    mesh = Mesh([0, 1, 2, 3, 4, 5, 6, 7], [4, 2], ["data", "model"])
    assert isinstance(mesh.device_ids, np.ndarray)
    assert mesh.device_ids.ndim == 1
    assert mesh.device_ids.dtype.kind == "i"
    assert mesh.device_ids.tolist() == list(range(8))
    assert mesh.mesh_shape == (4, 2)
    assert type(mesh.mesh_shape[0]) is int
    assert mesh.axis_names == ("data", "model")
    assert mesh.ndim == 2


@pytest.mark.parametrize(
    "device_ids",
    [
        list(range(8)),
        tuple(range(8)),
        range(8),
        np.arange(8),
        np.arange(8, dtype=np.int32),
        np.arange(8, dtype=np.uint8),
        np.arange(8).reshape(2, 4),  # Any shape: flattened row-major.
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [np.int64(i) for i in range(8)],
    ],
)
def test_accepted_device_id_types(device_ids):
    mesh = Mesh(device_ids, (2, 4))
    assert mesh.device_ids.tolist() == list(range(8))
    assert mesh.device_ids.shape == (8,)


def test_size_and_shape():
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    assert mesh.size() == 8
    assert mesh.shape() == OrderedDict([("data", 4), ("model", 2)])
    assert isinstance(mesh.shape(), OrderedDict)
    assert list(mesh.shape()) == ["data", "model"]


def test_shape_without_axis_names_has_int_keys():
    mesh = Mesh(range(8), (2, 2, 2))
    assert mesh.axis_names is None
    assert mesh.shape() == OrderedDict([(0, 2), (1, 2), (2, 2)])


def test_get_logical_mesh_is_row_major():
    mesh = Mesh([7, 6, 5, 4, 3, 2, 1, 0], (2, 4))
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), [[7, 6, 5, 4], [3, 2, 1, 0]]
    )
    np.testing.assert_array_equal(
        Mesh(range(8), (4, 2)).get_logical_mesh(), [[0, 1], [2, 3], [4, 5], [6, 7]]
    )


def test_get_axis_name_idx():
    mesh = Mesh(range(8), (2, 2, 2), ("x", "y", "z"))
    assert mesh.get_axis_name_idx("x") == 0
    assert mesh.get_axis_name_idx("z") == 2
    assert mesh.get_axis_name_idx("w") is None
    assert Mesh(range(8), (8,)).get_axis_name_idx("x") is None


def test_subset_of_devices_is_accepted():
    # "Local SPMD" (pytorch/xla #9181): a mesh need not use every device.
    mesh = Mesh([4, 5, 6, 7], (2, 2), ("a", "b"))
    np.testing.assert_array_equal(mesh.get_logical_mesh(), [[4, 5], [6, 7]])
    assert Mesh([7, 0], (2,)).device_ids.tolist() == [7, 0]
    assert Mesh([3], (1,)).size() == 1


# --------------------------------------------------------------------------
# Validation errors
# --------------------------------------------------------------------------


def test_device_count_must_match_mesh_size():
    with pytest.raises(
        ValueError,
        match=r"Number of device IDs \(6\) must match the mesh size 8 = "
        r"prod\(\(4, 2\)\)\. Pass 8 device IDs, or choose a mesh_shape whose "
        r"product is 6",
    ):
        Mesh(range(6), (4, 2))
    with pytest.raises(ValueError, match=r"Number of device IDs \(0\)"):
        Mesh([], (1,))


def test_duplicate_device_ids_are_named():
    with pytest.raises(
        ValueError, match=r"Device IDs must be unique, but \[1, 3\] appear more than once"
    ):
        Mesh([0, 1, 1, 3, 3, 3], (6,))


def test_out_of_range_device_ids_are_named():
    with pytest.raises(
        ValueError,
        match=r"Device IDs \[8, 9\] are out of range: valid device IDs are 0\.\.7 "
        r"\(the global device count is 8\)\. Use IDs from range\(8\)",
    ):
        Mesh([9, 0, 8, 1], (2, 2))
    with pytest.raises(ValueError, match=r"Device IDs \[-1\] are out of range"):
        Mesh([-1, 0], (2,))


def test_device_count_comes_from_runtime_helper(monkeypatch):
    monkeypatch.setattr(xshard.mesh.mesh, "_global_device_count", lambda: 4)
    Mesh(range(4), (4,))
    with pytest.raises(ValueError, match=r"valid device IDs are 0\.\.3"):
        Mesh(range(8), (8,))


def test_wrong_number_of_axis_names():
    with pytest.raises(
        ValueError,
        match=r"Number of axis names \(3\) must match the number of mesh "
        r"dimensions \(2\): got axis_names=\('a', 'b', 'c'\)",
    ):
        Mesh(range(8), (4, 2), ("a", "b", "c"))


def test_duplicate_axis_names():
    with pytest.raises(
        ValueError, match=r"Axis names must be unique, but \['x'\] appear more than once"
    ):
        Mesh(range(8), (2, 2, 2), ("x", "y", "x"))


@pytest.mark.parametrize(
    "axis_names, match",
    [
        ("data", r"got the str 'data'\. Use \('data',\) for a single axis"),
        ({"data": 0}, r"axis_names must be a tuple of str or None, got dict"),
        ((0,), r"axis_names entries must be non-empty strs, got 0"),
        (("",), r"axis_names entries must be non-empty strs, got ''"),
    ],
)
def test_axis_names_type_errors(axis_names, match):
    with pytest.raises(TypeError, match=match):
        Mesh(range(8), (8,), axis_names)


@pytest.mark.parametrize(
    "mesh_shape, error, match",
    [
        (8, TypeError, r"mesh_shape must be a tuple of positive ints, got int 8\. Use \(8,\)"),
        ("8", TypeError, r"mesh_shape must be a tuple of positive ints, got str"),
        ((4.0, 2), TypeError, r"got 4\.0 \(float\) at index 0 of \(4\.0, 2\)"),
        ((True, 8), TypeError, r"got True \(bool\) at index 0"),
        ((8, 0), ValueError, r"got 0 at index 1 of \(8, 0\)\. Every mesh axis needs"),
        ((-8,), ValueError, r"got -8 at index 0"),
        ((), ValueError, r"mesh_shape must have at least one axis, got \(\)"),
    ],
)
def test_mesh_shape_errors(mesh_shape, error, match):
    with pytest.raises(error, match=match):
        Mesh(range(8), mesh_shape)


@pytest.mark.parametrize(
    "device_ids, error, match",
    [
        ({0, 1}, TypeError, r"device_ids must be a list, tuple, range or numpy array of ints, got set"),
        (iter(range(2)), TypeError, r"got range_iterator"),
        ([0, 1.5], TypeError, r"device_ids must contain only ints, got \[0\.0, 1\.5\]"),
        (np.array([0.0, 1.0]), TypeError, r"device_ids must contain only ints"),
        (["0", "1"], TypeError, r"got \['0', '1'\]"),
        ([True, False], TypeError, r"device_ids must contain only ints, got \[True, False\]"),
        ([0, None], TypeError, r"got \[None\]"),
        ([[0, 1], [2]], ValueError, r"flat or rectangular nested sequence"),
    ],
)
def test_device_ids_errors(device_ids, error, match):
    with pytest.raises(error, match=match):
        Mesh(device_ids, (2,))


# --------------------------------------------------------------------------
# axis_index
# --------------------------------------------------------------------------


def test_axis_index_resolves_names_and_ints():
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    assert mesh.axis_index("data") == 0
    assert mesh.axis_index("model") == 1
    assert mesh.axis_index(1) == 1
    assert mesh.axis_index(np.int64(0)) == 0
    assert Mesh(range(8), (4, 2)).axis_index(1) == 1


def test_axis_index_errors_name_the_mesh_axes():
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    with pytest.raises(
        ValueError,
        match=r"Axis name 'z' is not defined in the given mesh: the mesh axes "
        r"are \('data', 'model'\)\. Use one of these names or an index in 0\.\.1",
    ):
        mesh.axis_index("z")
    with pytest.raises(
        ValueError,
        match=r"Mesh axis index 2 is out of range for the mesh of shape \(4, 2\) "
        r"\('data', 'model'\): valid indices are 0\.\.1",
    ):
        mesh.axis_index(2)
    with pytest.raises(ValueError, match=r"Mesh axis index -1 is out of range"):
        mesh.axis_index(-1)
    with pytest.raises(
        ValueError, match=r"the mesh of shape \(8,\) has no axis names\. Refer to its axes by index 0\.\.0"
    ):
        Mesh(range(8), (8,)).axis_index("data")
    with pytest.raises(TypeError, match=r"got NoneType None"):
        mesh.axis_index(None)
    with pytest.raises(TypeError, match=r"got bool True"):
        mesh.axis_index(True)


# --------------------------------------------------------------------------
# Value semantics: repr, equality, hashing, immutability
# --------------------------------------------------------------------------


def test_repr_is_exact_and_round_trips():
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    assert repr(mesh) == (
        "Mesh(device_ids=[0, 1, 2, 3, 4, 5, 6, 7], mesh_shape=(4, 2), "
        "axis_names=('data', 'model'))"
    )
    for m in [mesh, Mesh([3, 1, 2, 0], (2, 2)), Mesh([5], (1,), ("x",))]:
        again = eval(repr(m), {"Mesh": Mesh})
        assert again == m
        assert repr(again) == repr(m)
    assert repr(Mesh([1, 0], (2,))) == (
        "Mesh(device_ids=[1, 0], mesh_shape=(2,), axis_names=None)"
    )


def test_equality_and_hash_by_value():
    a = Mesh(range(8), (4, 2), ("data", "model"))
    b = Mesh(np.arange(8).reshape(4, 2), [4, 2], ["data", "model"])
    assert a == b
    assert hash(a) == hash(b)
    assert {a: "cached"}[b] == "cached"
    assert len({a, b}) == 1

    assert a != Mesh(range(8), (2, 4), ("data", "model"))  # Shape.
    assert a != Mesh(range(8), (4, 2), ("x", "model"))  # Names.
    assert a != Mesh(range(8), (4, 2))  # No names.
    assert a != Mesh([1, 0, 2, 3, 4, 5, 6, 7], (4, 2), ("data", "model"))  # Order.
    assert a != "Mesh"
    assert a != (tuple(range(8)), (4, 2), ("data", "model"))


def test_mesh_is_immutable():
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    with pytest.raises(AttributeError, match=r"Mesh is immutable: cannot set 'mesh_shape'"):
        mesh.mesh_shape = (8,)
    with pytest.raises(AttributeError, match=r"immutable"):
        mesh.device_ids = np.arange(8)
    with pytest.raises(AttributeError, match=r"immutable"):
        mesh.new_attribute = 1
    with pytest.raises(AttributeError, match=r"cannot delete 'device_ids'"):
        del mesh.device_ids
    with pytest.raises(ValueError, match=r"read-only"):
        mesh.device_ids[0] = 5
    with pytest.raises(ValueError, match=r"read-only"):
        mesh.get_logical_mesh()[0, 0] = 5
    assert mesh.device_ids.tolist() == list(range(8))


def test_mesh_copies_its_input():
    ids = np.arange(8)
    mesh = Mesh(ids, (8,))
    ids[0] = 7
    assert mesh.device_ids.tolist() == list(range(8))
    assert ids.flags.writeable  # The caller's array is left alone.


def test_copy_and_pickle():
    mesh = Mesh([3, 2, 1, 0], (2, 2), ("a", "b"))
    assert copy.copy(mesh) is mesh
    assert copy.deepcopy(mesh) is mesh
    again = pickle.loads(pickle.dumps(mesh))
    assert again == mesh
    assert hash(again) == hash(mesh)
    assert not again.device_ids.flags.writeable
    with pytest.raises(AttributeError):
        again.mesh_shape = (4,)


# --------------------------------------------------------------------------
# AbstractMesh
# --------------------------------------------------------------------------


def test_abstract_mesh_has_no_devices():
    a = Mesh(range(8), (4, 2), ("data", "model"))
    b = Mesh(range(7, -1, -1), (4, 2), ("data", "model"))
    assert a != b
    assert a.abstract == b.abstract == AbstractMesh((4, 2), ("data", "model"))
    assert hash(a.abstract) == hash(b.abstract)
    assert repr(a.abstract) == "AbstractMesh(mesh_shape=(4, 2), axis_names=('data', 'model'))"
    assert eval(repr(a.abstract), {"AbstractMesh": AbstractMesh}) == a.abstract
    assert not hasattr(a.abstract, "device_ids")
    assert a.abstract != Mesh(range(8), (4, 2)).abstract


def test_abstract_mesh_api():
    abstract = AbstractMesh([4, 2], ["data", "model"])
    assert abstract.mesh_shape == (4, 2)
    assert abstract.axis_names == ("data", "model")
    assert abstract.size() == 8
    assert abstract.ndim == 2
    assert abstract.shape() == OrderedDict([("data", 4), ("model", 2)])
    assert abstract.axis_index("model") == 1
    assert abstract.get_axis_name_idx("nope") is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        abstract.mesh_shape = (8,)


def test_abstract_mesh_validates():
    with pytest.raises(ValueError, match=r"Number of axis names \(1\)"):
        AbstractMesh((4, 2), ("data",))
    with pytest.raises(ValueError, match=r"got 0 at index 0"):
        AbstractMesh((0,))


# --------------------------------------------------------------------------
# get_1d_mesh
# --------------------------------------------------------------------------


def test_get_1d_mesh():
    mesh = get_1d_mesh()
    assert mesh == Mesh(range(8), (8,))
    assert mesh.axis_names is None
    named = get_1d_mesh("data")
    assert named.axis_names == ("data",)
    assert named.shape() == OrderedDict([("data", 8)])
    np.testing.assert_array_equal(named.get_logical_mesh(), np.arange(8))


def test_get_1d_mesh_follows_device_count(monkeypatch):
    monkeypatch.setattr(xshard.mesh.mesh, "_global_device_count", lambda: 1)
    assert get_1d_mesh("x") == Mesh([0], (1,), ("x",))


def test_get_1d_mesh_rejects_non_str_name():
    with pytest.raises(TypeError, match=r"axis_name must be a str or None, got tuple"):
        get_1d_mesh(("data",))


# --------------------------------------------------------------------------
# HybridMesh
# --------------------------------------------------------------------------


def reference_hybrid_logical_mesh(granules, ici, dcn):
    """Independent oracle: the device at each mesh coordinate, one at a time.

    Along mesh axis i, coordinate c splits as c = d * ici[i] + j: d picks the
    granule coordinate (outer, DCN), j the position inside the granule (ICI).
    """
    shape = tuple(d * i for d, i in zip(dcn, ici))
    out = np.empty(shape, dtype=np.int64)
    for coord in itertools.product(*(range(n) for n in shape)):
        dcn_coord = [c // i for c, i in zip(coord, ici)]
        ici_coord = [c % i for c, i in zip(coord, ici)]
        granule = granules[np.ravel_multi_index(dcn_coord, dcn)]
        out[coord] = granule[np.ravel_multi_index(ici_coord, ici)]
    return out


def test_hybrid_dcn_outer_on_first_axis():
    # One host split into 2 simulated slices [0..3], [4..7]; slice blocks
    # [[0, 1], [2, 3]] and [[4, 5], [6, 7]] stacked along axis 0.
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1))
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), [[0, 1], [2, 3], [4, 5], [6, 7]]
    )
    assert mesh.mesh_shape == (4, 2)
    assert mesh.ici_mesh_shape == (2, 2)
    assert mesh.dcn_mesh_shape == (2, 1)


def test_hybrid_dcn_outer_on_second_axis():
    # The same slice blocks placed side by side along axis 1.
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=("x", "y"))
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), [[0, 1, 4, 5], [2, 3, 6, 7]]
    )
    assert mesh.shape() == OrderedDict([("x", 2), ("y", 4)])


def test_hybrid_four_slices_interleaves_axes():
    # 4 slices of 2 ([0, 1], [2, 3], [4, 5], [6, 7]) on a 2x2 DCN grid, each
    # a 2x1 block: row 2*d0 + i0 holds slice (d0, d1)'s device i0 for d1 = 0, 1.
    mesh = HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(2, 2))
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), [[0, 2], [1, 3], [4, 6], [5, 7]]
    )


def test_hybrid_groups_by_process(monkeypatch):
    # Two processes owning interleaved device IDs.
    use_granules(monkeypatch, [[0, 2, 4, 6], [1, 3, 5, 7]])
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1), axis_names=("dp", "tp"))
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), [[0, 2], [4, 6], [1, 3], [5, 7]]
    )
    mesh = HybridMesh(ici_mesh_shape=(1, 4), dcn_mesh_shape=(2, 1))
    np.testing.assert_array_equal(mesh.get_logical_mesh(), [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_hybrid_without_dcn_is_plain_row_major():
    mesh = HybridMesh(ici_mesh_shape=(4, 2), axis_names=("data", "model"))
    assert mesh.dcn_mesh_shape == (1, 1)
    assert mesh == Mesh(range(8), (4, 2), ("data", "model"))
    assert isinstance(mesh, Mesh)


@pytest.mark.parametrize(
    "ici, dcn",
    [
        ((2, 2), (2, 1)),
        ((2, 2), (1, 2)),
        ((2, 1), (2, 2)),
        ((1, 2), (2, 2)),
        ((4,), (2,)),
        ((1, 2, 2), (2, 1, 1)),
        ((2, 1, 2), (1, 2, 1)),
        ((1, 1, 1), (2, 2, 2)),
        ((2, 2, 2), (1, 1, 1)),
    ],
)
@pytest.mark.parametrize("interleaved", [False, True])
def test_hybrid_matches_reference(monkeypatch, ici, dcn, interleaved):
    n = math.prod(dcn)
    if interleaved:  # Process p owns IDs p, p + n, p + 2n, ...
        granules = [list(range(p, 8, n)) for p in range(n)]
        use_granules(monkeypatch, granules)
    else:  # One host, split into contiguous simulated slices.
        size = 8 // n
        granules = [list(range(g * size, (g + 1) * size)) for g in range(n)]
    mesh = HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn)
    np.testing.assert_array_equal(
        mesh.get_logical_mesh(), reference_hybrid_logical_mesh(granules, ici, dcn)
    )
    assert sorted(mesh.device_ids.tolist()) == list(range(8))


def test_hybrid_value_semantics():
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=("x", "y"))
    assert repr(mesh) == (
        "HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=('x', 'y'))"
    )
    assert eval(repr(mesh), {"HybridMesh": HybridMesh}) == mesh
    # Equal to the plain Mesh with the same layout: both shard the same way.
    plain = Mesh([0, 1, 4, 5, 2, 3, 6, 7], (2, 4), ("x", "y"))
    assert mesh == plain
    assert hash(mesh) == hash(plain)
    with pytest.raises(AttributeError, match=r"HybridMesh is immutable"):
        mesh.ici_mesh_shape = (4, 1)
    again = pickle.loads(pickle.dumps(mesh))
    assert type(again) is HybridMesh
    assert again == mesh
    assert again.dcn_mesh_shape == (1, 2)


def test_hybrid_is_keyword_only():
    with pytest.raises(TypeError):
        HybridMesh((2, 2), (2, 1))


def test_hybrid_shape_lengths_must_match():
    with pytest.raises(
        ValueError,
        match=r"ici_mesh_shape \(2, 2\) and dcn_mesh_shape \(2,\) must have the same "
        r"length \(one entry per mesh axis\), got 2 and 1\. Pad the shorter one with 1s",
    ):
        HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2,))


def test_hybrid_granule_count_must_match_dcn(monkeypatch):
    use_granules(monkeypatch, [[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(
        ValueError,
        match=r"The devices form 2 slices/processes, but prod\(dcn_mesh_shape\) = "
        r"prod\(\(1, 1\)\) = 1\. Set dcn_mesh_shape so that its product is 2",
    ):
        HybridMesh(ici_mesh_shape=(2, 2))
    with pytest.raises(ValueError, match=r"form 2 slices/processes, but .* = 4"):
        HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 2))


def test_hybrid_single_host_split_must_divide():
    with pytest.raises(
        ValueError,
        match=r"Cannot split the 8 devices of a single host into "
        r"prod\(dcn_mesh_shape\) = 3 equal simulated slices: 8 is not divisible by 3",
    ):
        HybridMesh(ici_mesh_shape=(1, 1), dcn_mesh_shape=(3, 1))


def test_hybrid_ici_must_fill_each_granule():
    with pytest.raises(
        ValueError,
        match=r"Each slice/process must hold prod\(ici_mesh_shape\) = "
        r"prod\(\(2, 2\)\) = 4 devices, but they hold \[8\]",
    ):
        HybridMesh(ici_mesh_shape=(2, 2))
    with pytest.raises(ValueError, match=r"= 2 devices, but they hold \[4\]"):
        HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2))


def test_hybrid_uneven_granules(monkeypatch):
    use_granules(monkeypatch, [[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"but they hold \[3, 5\]"):
        HybridMesh(ici_mesh_shape=(4,), dcn_mesh_shape=(2,))


def test_hybrid_shape_type_errors():
    with pytest.raises(TypeError, match=r"ici_mesh_shape must be a tuple of positive ints, got int 8"):
        HybridMesh(ici_mesh_shape=8)
    with pytest.raises(ValueError, match=r"dcn_mesh_shape entries must be positive ints, got 0"):
        HybridMesh(ici_mesh_shape=(8,), dcn_mesh_shape=(0,))
    with pytest.raises(ValueError, match=r"Number of axis names \(1\)"):
        HybridMesh(ici_mesh_shape=(4, 2), axis_names=("data",))


def test_device_granules_groups_by_process_then_slice(monkeypatch):
    def fake_devices(**attrs):
        n = len(next(iter(attrs.values())))
        return [
            types.SimpleNamespace(**{k: v[i] for k, v in attrs.items()}) for i in range(n)
        ]

    monkeypatch.setattr(
        xshard.mesh.mesh, "_runtime_devices",
        lambda: fake_devices(process_index=[1, 0, 1, 0]),
    )
    assert real_device_granules() == [[1, 3], [0, 2]]

    # A slice index, when present, wins over the process index.
    monkeypatch.setattr(
        xshard.mesh.mesh, "_runtime_devices",
        lambda: fake_devices(process_index=[0, 1, 2, 3], slice_index=[0, 0, 1, 1]),
    )
    assert real_device_granules() == [[0, 1], [2, 3]]


# --------------------------------------------------------------------------
# Global mesh
# --------------------------------------------------------------------------


def test_global_mesh_set_and_get():
    assert get_global_mesh() is None
    mesh = Mesh(range(8), (4, 2), ("data", "model"))
    set_global_mesh(mesh)
    assert get_global_mesh() is mesh
    hybrid = HybridMesh(ici_mesh_shape=(8,))
    set_global_mesh(hybrid)
    assert get_global_mesh() is hybrid
    set_global_mesh(None)
    assert get_global_mesh() is None


@pytest.mark.parametrize("not_a_mesh", ["data", (8,), AbstractMesh((8,))])
def test_global_mesh_rejects_non_mesh(not_a_mesh):
    with pytest.raises(TypeError, match=r"set_global_mesh expects an xshard Mesh"):
        set_global_mesh(not_a_mesh)
    assert get_global_mesh() is None


# --------------------------------------------------------------------------
# JAX mesh and import structure
# --------------------------------------------------------------------------


@pytest.fixture
def jax_runtime(monkeypatch):
    jax = pytest.importorskip("jax")
    monkeypatch.setattr(xshard.mesh.mesh, "_runtime_devices", jax.devices)
    monkeypatch.setattr(xshard.mesh.mesh, "_global_device_count", jax.device_count)
    return jax


def test_get_jax_mesh_single_device(jax_runtime):
    jax = jax_runtime
    jax_mesh = Mesh([0], (1,)).get_jax_mesh()
    assert isinstance(jax_mesh, jax.sharding.Mesh)
    assert jax_mesh.axis_names == ("axis_0",)
    assert jax_mesh.devices.shape == (1,)
    assert jax_mesh.devices[0] == jax.devices()[0]

    mesh = Mesh([0], (1, 1), ("data", "model"))
    assert mesh.get_jax_mesh().axis_names == ("data", "model")
    assert mesh.get_jax_mesh() is mesh.get_jax_mesh()  # Cached.


def test_get_jax_mesh_device_layout(jax_runtime):
    jax = jax_runtime
    n = jax.device_count()
    if n < 2 or n % 2:
        pytest.skip(f"needs an even number of at least 2 JAX devices, have {n}")
    ids = list(reversed(range(n)))
    mesh = Mesh(ids, (2, n // 2), ("x", "y"))
    jax_mesh = mesh.get_jax_mesh()
    assert dict(jax_mesh.shape) == {"x": 2, "y": n // 2}
    devices = jax.devices()
    expected = [[devices[i] for i in row] for row in mesh.get_logical_mesh().tolist()]
    assert jax_mesh.devices.tolist() == expected


