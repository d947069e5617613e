"""Tests for xshard.spmd.spec: partition specs, tile assignments, shard geometry.

Oracles: PyTorch/XLA's documented strings (reference section 5), XLA's own
HloSharding parser/printer from jaxlib, JAX's NamedSharding lowering, and eager
CPU torch for shard contents. No accelerator and no extra JAX devices needed.
"""

import doctest
import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from jax._src.lib import xla_client as xc
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from xshard.spmd import spec as spec_module
from xshard.spmd.spec import (
    PartitionSpecError,
    PartitionSpecTypeError,
    ShardIndex,
    ShardingPlan,
    ShardingType,
    normalize_spec,
    padded_shape,
    plan_for_mesh,
    plan_sharding,
    shard_indices,
    shard_shape,
    to_jax_partition_spec,
)

IDS8 = tuple(range(8))
REVERSED8 = tuple(reversed(range(8)))
PERMUTED8 = (3, 1, 4, 0, 7, 5, 2, 6)
NAMES = ("data", "model")
REP = " last_tile_dim_replicate"


def plan(device_ids, mesh_shape, user_spec, axis_names=None):
    canonical = normalize_spec(user_spec, len(user_spec), mesh_shape, axis_names)
    return plan_sharding(tuple(device_ids), tuple(mesh_shape), canonical)


# --------------------------------------------------------------------------
# Exact HLO sharding strings
# --------------------------------------------------------------------------

# (device_ids, mesh_shape, user spec, expected string, expected type)
STRING_CASES = [
    # 1-D mesh.
    (IDS8, (8,), (0,), "{devices=[8]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8,), (None, 0), "{devices=[1,8]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8,), (0, None), "{devices=[8,1]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8,), (None,), "{replicated}", ShardingType.REPLICATED),
    (IDS8, (8,), (), "{replicated}", ShardingType.REPLICATED),  # A scalar.
    # 2-D mesh (2, 4), every ordering for a rank-2 tensor.
    (IDS8, (2, 4), (0, 1), "{devices=[2,4]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (2, 4), (1, 0), "{devices=[4,2]0,4,1,5,2,6,3,7}", ShardingType.TILED),
    (IDS8, (2, 4), (0, None), "{devices=[2,1,4]0,1,2,3,4,5,6,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 4), (None, 0), "{devices=[1,2,4]0,1,2,3,4,5,6,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 4), (1, None), "{devices=[4,1,2]0,4,1,5,2,6,3,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 4), (None, 1), "{devices=[1,4,2]0,4,1,5,2,6,3,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 4), (None, None), "{replicated}", ShardingType.REPLICATED),
    (IDS8, (2, 4), ((0, 1), None), "{devices=[8,1]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (2, 4), ((1, 0), None), "{devices=[8,1]0,4,1,5,2,6,3,7}", ShardingType.TILED),
    (IDS8, (2, 4), (None, (1, 0)), "{devices=[1,8]0,4,1,5,2,6,3,7}", ShardingType.TILED),
    (IDS8, (2, 4), ((0, 1),), "{devices=[8]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (2, 4), (0,), "{devices=[2,4]0,1,2,3,4,5,6,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 4), (1,), "{devices=[4,2]0,4,1,5,2,6,3,7" + REP + "}", ShardingType.PARTIAL),
    # A None in the spec but every mesh axis used: fully tiled, not partial.
    (IDS8, (2, 4), (None, 1, 0), "{devices=[1,4,2]0,4,1,5,2,6,3,7}", ShardingType.TILED),
    # 2-D mesh (4, 2).
    (IDS8, (4, 2), (0, 1), "{devices=[4,2]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (4, 2), (1, 0), "{devices=[2,4]0,2,4,6,1,3,5,7}", ShardingType.TILED),
    (IDS8, (4, 2), (0, None), "{devices=[4,1,2]0,1,2,3,4,5,6,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (4, 2), (None, 0), "{devices=[1,4,2]0,1,2,3,4,5,6,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (4, 2), (1, None), "{devices=[2,1,4]0,2,4,6,1,3,5,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (4, 2), (None, 1), "{devices=[1,2,4]0,2,4,6,1,3,5,7" + REP + "}", ShardingType.PARTIAL),
    # 4-D mesh (2, 1, 2, 2) with tuple entries; device (a, b, c, d) is 4a+2c+d.
    (IDS8, (2, 1, 2, 2), ((3, 0), None, 1), "{devices=[4,1,1,2]0,2,4,6,1,3,5,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 1, 2, 2), ((0, 2), (3,)), "{devices=[4,2]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (2, 1, 2, 2), ((2, 3), 0), "{devices=[4,2]0,4,1,5,2,6,3,7}", ShardingType.TILED),
    (IDS8, (2, 1, 2, 2), (None, (3, 2)), "{devices=[1,4,2]0,4,2,6,1,5,3,7" + REP + "}", ShardingType.PARTIAL),
    (IDS8, (2, 1, 2, 2), ((1,), None), "{replicated}", ShardingType.REPLICATED),
    # Custom device order: reversed ids.
    (REVERSED8, (2, 4), (0, 1), "{devices=[2,4]7,6,5,4,3,2,1,0}", ShardingType.TILED),
    (REVERSED8, (2, 4), (1, 0), "{devices=[4,2]7,3,6,2,5,1,4,0}", ShardingType.TILED),
    # Devices are sorted inside each replication group (reference section 5).
    (REVERSED8, (2, 4), (None, 1), "{devices=[1,4,2]3,7,2,6,1,5,0,4" + REP + "}", ShardingType.PARTIAL),
    (REVERSED8, (2, 4), (0, None), "{devices=[2,1,4]4,5,6,7,0,1,2,3" + REP + "}", ShardingType.PARTIAL),
    (REVERSED8, (1, 8), (None, 1), "{devices=[1,8]7,6,5,4,3,2,1,0}", ShardingType.TILED),
    (REVERSED8, (2, 4), (None, None), "{replicated}", ShardingType.REPLICATED),
    # Custom device order: a permutation; logical mesh [[3,1,4,0],[7,5,2,6]].
    (PERMUTED8, (2, 4), (0, 1), "{devices=[2,4]3,1,4,0,7,5,2,6}", ShardingType.TILED),
    (PERMUTED8, (2, 4), (1, 0), "{devices=[4,2]3,7,1,5,4,2,0,6}", ShardingType.TILED),
    (PERMUTED8, (2, 4), (1, None), "{devices=[4,1,2]3,7,1,5,2,4,0,6" + REP + "}", ShardingType.PARTIAL),
    (PERMUTED8, (2, 4), (None, 0), "{devices=[1,2,4]0,1,3,4,2,5,6,7" + REP + "}", ShardingType.PARTIAL),
    # A mesh over a subset of the devices ("local SPMD").
    ((4, 5, 6, 7), (4,), (0,), "{devices=[4]4,5,6,7}", ShardingType.TILED),
    # Size-1 mesh axes: (8, 1) and (1, 8).
    (IDS8, (8, 1), (0, None), "{devices=[8,1]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8, 1), (0, 1), "{devices=[8,1]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8, 1), (1, 0), "{devices=[1,8]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (8, 1), (None, 1), "{replicated}", ShardingType.REPLICATED),
    (IDS8, (1, 8), (0, None), "{replicated}", ShardingType.REPLICATED),
    (IDS8, (1, 8), (None, 1), "{devices=[1,8]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    (IDS8, (1, 8), (1, None), "{devices=[8,1]0,1,2,3,4,5,6,7}", ShardingType.TILED),
    # One device: REPLICATED (torch_xla says MAXIMAL, XLA prints {replicated}).
    ((0,), (1,), (0,), "{replicated}", ShardingType.REPLICATED),
    ((5,), (1, 1), (0, 1), "{replicated}", ShardingType.REPLICATED),
]


def _case_id(case):
    ids, mesh_shape, user_spec = case[:3]
    order = {IDS8: "ids", REVERSED8: "rev", PERMUTED8: "perm"}.get(ids, str(ids))
    return f"{order}-mesh{mesh_shape}-spec{user_spec}".replace(" ", "")


@pytest.mark.parametrize("case", STRING_CASES, ids=_case_id)
def test_hlo_sharding_string(case):
    ids, mesh_shape, user_spec, expected, expected_type = case
    p = plan(ids, mesh_shape, user_spec)
    assert p.hlo_sharding == expected
    assert p.sharding_type == expected_type
    # XLA's own parser and printer give back exactly our string.
    assert str(xc.HloSharding.from_string(expected)) == expected


def test_named_and_index_specs_agree():
    by_name = plan(IDS8, (2, 4), ("model", "data"), NAMES)
    by_index = plan(IDS8, (2, 4), (1, 0), NAMES)
    mixed = plan(IDS8, (2, 4), ((1, "data"), None), NAMES)
    assert by_name is by_index  # Same canonical key, same cached plan.
    assert by_name.hlo_sharding == "{devices=[4,2]0,4,1,5,2,6,3,7}"
    assert mixed.hlo_sharding == "{devices=[8,1]0,4,1,5,2,6,3,7}"


def test_reference_worked_example():
    p = plan(REVERSED8, (2, 4), (None, "model"), NAMES)
    assert p.tile_shape == (1, 4)
    assert p.replicate_factor == 2
    np.testing.assert_array_equal(
        p.tile_assignment, [[[3, 7], [2, 6], [1, 5], [0, 4]]]
    )


# --------------------------------------------------------------------------
# Checking every spec against XLA and JAX
# --------------------------------------------------------------------------


def _all_canonical_specs(num_axes, ndim):
    """Every canonical spec of rank ``ndim`` over a mesh with ``num_axes`` axes."""
    # Assign each mesh axis to a tensor dimension or to "unused" (ndim).
    for owner in itertools.product(range(ndim + 1), repeat=num_axes):
        groups = [[a for a in range(num_axes) if owner[a] == d] for d in range(ndim)]
        for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
            yield tuple(tuple(o) if o else None for o in orders)


MESHES = [(8,), (2, 4), (4, 2), (8, 1), (1, 8), (2, 2, 2), (2, 1, 2, 2), (1,)]


def _all_plans(device_ids_for):
    for mesh_shape in MESHES:
        ids = device_ids_for(math.prod(mesh_shape))
        for ndim in (0, 1, 2, 3):
            for spec in _all_canonical_specs(len(mesh_shape), ndim):
                yield plan_sharding(ids, mesh_shape, spec)


def _xla_from_unnormalised_layout(p: ShardingPlan) -> xc.HloSharding:
    """XLA's HloSharding for PyTorch/XLA's layout before XLA normalises it.

    Builds the tile assignment the way torch_xla does (no sorting, the
    replication dimension always present) and lets XLA's from_proto do the
    normalisation that plan_sharding reimplements.
    """
    used = [a for entry in p.spec if entry for a in entry]
    unused = [a for a in range(len(p.mesh_shape)) if a not in used]
    raw = np.array(p.device_ids).reshape(p.mesh_shape).transpose(used + unused)
    op = xc.OpSharding()
    op.type = xc.OpSharding.Type.OTHER
    op.tile_assignment_dimensions = [*p.tile_shape, p.replicate_factor]
    op.tile_assignment_devices = [int(d) for d in raw.ravel()]
    op.replicate_on_last_tile_dim = True
    return xc.HloSharding.from_proto(op)


def _xla_sharding_type(hlo: xc.HloSharding) -> ShardingType:
    # torch_xla's ShardingUtil::GetShardingType on the stored proto.
    if hlo.is_replicated():
        return ShardingType.REPLICATED
    if hlo.replicate_on_last_tile_dim():
        return ShardingType.PARTIAL
    return ShardingType.TILED


@pytest.mark.parametrize(
    "device_ids_for",
    [
        lambda n: tuple(range(n)),
        lambda n: tuple(reversed(range(n))),
        lambda n: tuple(int(i) for i in np.random.default_rng(n).permutation(n) + 16),
    ],
    ids=["identity", "reversed", "permuted"],
)
def test_every_spec_matches_xla_normalisation(device_ids_for):
    count = 0
    for p in _all_plans(device_ids_for):
        xla = _xla_from_unnormalised_layout(p)
        assert p.hlo_sharding == str(xla), (p.mesh_shape, p.spec)
        assert p.sharding_type == _xla_sharding_type(xla), (p.mesh_shape, p.spec)
        assert str(xc.HloSharding.from_string(p.hlo_sharding)) == p.hlo_sharding
        count += 1
    assert count > 1000


def test_every_spec_matches_jax_named_sharding():
    try:
        from jax._src.named_sharding import named_sharding_to_xla_hlo_sharding
    except ImportError:  # A private JAX helper; skip if it moves.
        pytest.skip("jax._src.named_sharding_to_xla_hlo_sharding not available")
    count = 0
    for p in _all_plans(lambda n: tuple(range(n))):
        names = tuple(f"axis_{i}" for i in range(len(p.mesh_shape)))
        sharding = NamedSharding(
            AbstractMesh(p.mesh_shape, names), to_jax_partition_spec(p.spec)
        )
        jax_hlo = named_sharding_to_xla_hlo_sharding(sharding, len(p.spec))
        assert xc.HloSharding.from_string(p.hlo_sharding) == jax_hlo, (
            p.mesh_shape,
            p.spec,
            str(jax_hlo),
        )
        count += 1
    assert count > 1000


# --------------------------------------------------------------------------
# ShardingPlan
# --------------------------------------------------------------------------


def test_plan_fields_and_tile_assignment():
    p = plan(PERMUTED8, (2, 4), (1, None))
    assert p.device_ids == PERMUTED8
    assert p.mesh_shape == (2, 4)
    assert p.spec == ((1,), None)
    assert p.tile_shape == (4, 1)
    assert p.replicate_factor == 2
    assert p.num_devices == 8
    assert p.tile_assignment.shape == (4, 1, 2)
    assert p.tile_assignment_devices == (3, 7, 1, 5, 2, 4, 0, 6)
    with pytest.raises(ValueError):
        p.tile_assignment[0, 0, 0] = 9  # Read-only view of a frozen plan.


def test_tiled_plan_keeps_a_replication_axis_of_one():
    p = plan(IDS8, (2, 4), (0, 1))
    assert p.tile_assignment.shape == (2, 4, 1)
    assert p.replicate_factor == 1


def test_plan_is_cached_frozen_and_hashable():
    a = plan_sharding(IDS8, (2, 4), ((0,), None))
    b = plan_sharding(IDS8, (2, 4), ((0,), None))
    assert a is b
    assert hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.replicate_factor = 2


def test_plan_for_mesh_accepts_a_mesh_like_object():
    mesh = SimpleNamespace(
        device_ids=np.array(REVERSED8), mesh_shape=(2, 4), axis_names=NAMES
    )
    p = plan_for_mesh(mesh, (None, "model"), 2)
    assert p.hlo_sharding == "{devices=[1,4,2]3,7,2,6,1,5,0,4" + REP + "}"
    with pytest.raises(PartitionSpecError, match="names mesh axis 'x'"):
        plan_for_mesh(mesh, (None, "x"), 2)


def test_plan_sharding_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"needs 8 device IDs, got 4"):
        plan_sharding((0, 1, 2, 3), (2, 4), ((0,), None))
    with pytest.raises(ValueError, match="Device IDs must be unique"):
        plan_sharding((0, 0, 1, 2), (4,), ((0,),))
    with pytest.raises(ValueError, match="not a canonical partition spec.*normalize_spec"):
        plan_sharding(IDS8, (2, 4), ("data", None))
    with pytest.raises(ValueError, match="not a canonical partition spec"):
        plan_sharding(IDS8, (2, 4), ((2,), None))
    with pytest.raises(ValueError, match="mesh axis 0 appears twice"):
        plan_sharding(IDS8, (2, 4), ((0,), (0,)))


def test_sharding_type_values_match_torch_xla():
    assert [(t.name, int(t)) for t in ShardingType] == [
        ("REPLICATED", 0),
        ("MAXIMAL", 1),
        ("TUPLE", 2),
        ("TILED", 3),
        ("MANUAL", 4),
        ("PARTIAL", 5),
        ("UNKNOWN", 6),
    ]


# --------------------------------------------------------------------------
# normalize_spec
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "user_spec, expected",
    [
        (("data", "model"), ((0,), (1,))),
        (("model", None), ((1,), None)),
        ((1, 0), ((1,), (0,))),
        ((("model", "data"), None), ((1, 0), None)),
        (([0, "model"], None), ((0, 1), None)),  # A list is a tuple.
        (((), None), (None, None)),  # An empty tuple is None.
        (((1,), None), ((1,), None)),
        ((np.int64(1), None), ((1,), None)),
        ([None, "data"], (None, (0,))),
        ((), ()),
    ],
)
def test_normalize_spec(user_spec, expected):
    ndim = len(user_spec)
    assert normalize_spec(user_spec, ndim, (2, 4), NAMES) == expected


def test_normalize_spec_without_axis_names():
    assert normalize_spec((None, (1, 0)), 2, (2, 4), None) == (None, (1, 0))


ERROR_CASES = [
    # (user spec, ndim, axis names, error type, message regex)
    (
        ("data", "x"),
        2,
        NAMES,
        PartitionSpecError,
        r"Partition spec \('data', 'x'\) for a rank-2 tensor names mesh axis 'x' "
        r"at dimension 1, but the mesh axes are \('data', 'model'\)\. Use one "
        r"of these names, an axis index in \[0, 2\), or None\.",
    ),
    (
        ("data",),
        1,
        None,
        PartitionSpecError,
        r"names mesh axis 'data' at dimension 0, but the mesh axes are unnamed, "
        r"with sizes \(2, 4\)\. Use an axis index in \[0, 2\) or None, or give "
        r"the mesh axis_names",
    ),
    (
        (0, None),
        3,
        NAMES,
        PartitionSpecError,
        r"Partition spec \(0, None\) has 2 entries, but the tensor has rank 3; "
        r"the mesh axes are \('data', 'model'\)\. Give exactly one entry per "
        r"tensor dimension",
    ),
    (
        (0, 2),
        2,
        NAMES,
        PartitionSpecError,
        r"uses mesh axis index 2 at dimension 1, but the mesh has 2 axes and "
        r"the mesh axes are \('data', 'model'\)\. Use one of these names, an "
        r"axis index in \[0, 2\), or None\.",
    ),
    (
        (-1, None),
        2,
        NAMES,
        PartitionSpecError,
        r"uses mesh axis index -1 at dimension 0",
    ),
    (
        ("data", 0),
        2,
        NAMES,
        PartitionSpecError,
        r"uses mesh axis 'data' \(index 0\) at dimensions 0 and 1, but each "
        r"mesh axis can split at most one dimension",
    ),
    (
        ((0, 1), "model"),
        2,
        NAMES,
        PartitionSpecError,
        r"uses mesh axis 'model' \(index 1\) at dimensions 0 and 1",
    ),
    (
        ((0, 0), None),
        2,
        None,
        PartitionSpecError,
        r"uses mesh axis 0 twice at dimension 0",
    ),
    (
        (((0, 1),), None),
        2,
        NAMES,
        PartitionSpecTypeError,
        r"nests \(0, 1\) inside the tuple at dimension 0; the mesh axes are "
        r"\('data', 'model'\)\. List the mesh axes of one dimension in a flat "
        r"tuple",
    ),
    (
        (None, 1.0),
        2,
        NAMES,
        PartitionSpecTypeError,
        r"has 1\.0 of type float at dimension 1, but an entry must be a mesh "
        r"axis name \(str\), a mesh axis index \(int\), a tuple of those, or "
        r"None; the mesh axes are \('data', 'model'\)",
    ),
    (
        (True, None),
        2,
        NAMES,
        PartitionSpecTypeError,
        r"has the bool True at dimension 0, which is not a mesh axis",
    ),
    (
        ((0, False), None),
        2,
        NAMES,
        PartitionSpecTypeError,
        r"has the bool False at dimension 0",
    ),
    (
        "data",
        1,
        NAMES,
        PartitionSpecTypeError,
        r"Partition spec must be a tuple with one entry per tensor dimension, "
        r"got str 'data' for a rank-1 tensor; the mesh axes are "
        r"\('data', 'model'\)\. Write it as a tuple, e.g. \(None,\)",
    ),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=lambda c: repr(c[0]))
def test_normalize_spec_errors(case):
    user_spec, ndim, axis_names, error, message = case
    with pytest.raises(error, match=message) as info:
        normalize_spec(user_spec, ndim, (2, 4), axis_names)
    assert isinstance(info.value, ValueError)  # One except catches them all.
    assert info.value.spec == user_spec


def test_normalize_spec_error_carries_the_dimension():
    with pytest.raises(PartitionSpecError) as info:
        normalize_spec((None, "x"), 2, (2, 4), NAMES)
    assert info.value.dim == 1


def test_type_errors_are_type_errors():
    with pytest.raises(TypeError, match="of type float"):
        normalize_spec((0.5,), 1, (2, 4), NAMES)


def test_normalize_spec_rejects_mismatched_axis_names():
    with pytest.raises(ValueError, match=r"Got 1 axis names \('data',\) for a mesh with 2 axes"):
        normalize_spec((0,), 1, (2, 4), ("data",))


# --------------------------------------------------------------------------
# Shard geometry
# --------------------------------------------------------------------------


def test_shard_and_padded_shapes():
    assert shard_shape((9,), (8,)) == (2,)
    assert padded_shape((9,), (8,)) == (16,)
    assert shard_shape((16,), (8,)) == (2,)
    assert padded_shape((16,), (8,)) == (16,)
    assert shard_shape((9, 5), (8, 2)) == (2, 3)
    assert padded_shape((9, 5), (8, 2)) == (16, 6)
    assert shard_shape((3, 7), (4, 1)) == (1, 7)
    assert padded_shape((3, 7), (4, 1)) == (4, 7)
    assert shard_shape((0, 4), (2, 2)) == (0, 2)
    assert shard_shape((), ()) == ()
    assert shard_shape(torch.Size([9, 5]), (8, 2)) == (2, 3)


def test_shard_shape_rejects_rank_mismatch():
    with pytest.raises(ValueError, match=r"shape \(9,\) has rank 1, but the sharding has 2 tile dimensions"):
        shard_shape((9,), (8, 1))
    with pytest.raises(TypeError, match="global_shape must be a tuple"):
        shard_shape(9, (8,))


def test_indices_nine_rows_over_eight_devices():
    p = plan(IDS8, (8,), (0,))
    got = shard_indices((9,), p)
    assert list(got) == list(IDS8)
    assert got == {
        0: ShardIndex((slice(0, 2, 1),), 0),
        1: ShardIndex((slice(2, 4, 1),), 0),
        2: ShardIndex((slice(4, 6, 1),), 0),
        3: ShardIndex((slice(6, 8, 1),), 0),
        4: ShardIndex((slice(8, 9, 1),), 0),  # One row plus one of padding.
        5: ShardIndex((slice(9, 9, 1),), 0),  # Only padding.
        6: ShardIndex((slice(9, 9, 1),), 0),
        7: ShardIndex((slice(9, 9, 1),), 0),
    }


def test_indices_uneven_2d_tiled():
    # Mesh (2, 4), spec (1, 0): tile (i, j) is held by device 4*j + i.
    p = plan(IDS8, (2, 4), (1, 0))
    got = shard_indices((5, 3), p)
    assert shard_shape((5, 3), p.tile_shape) == (2, 2)
    assert got[0] == ShardIndex((slice(0, 2, 1), slice(0, 2, 1)), 0)
    assert got[4] == ShardIndex((slice(0, 2, 1), slice(2, 3, 1)), 0)
    assert got[1] == ShardIndex((slice(2, 4, 1), slice(0, 2, 1)), 0)
    assert got[2] == ShardIndex((slice(4, 5, 1), slice(0, 2, 1)), 0)
    assert got[6] == ShardIndex((slice(4, 5, 1), slice(2, 3, 1)), 0)
    assert got[3] == ShardIndex((slice(5, 5, 1), slice(0, 2, 1)), 0)
    assert got[7] == ShardIndex((slice(5, 5, 1), slice(2, 3, 1)), 0)


def test_replica_ids_partial_are_positions_in_sorted_groups():
    # Reversed ids, mesh (2, 4), spec (0, None): tile 0 is held by the first
    # mesh row [7, 6, 5, 4], sorted by XLA into [4, 5, 6, 7].
    p = plan(REVERSED8, (2, 4), (0, None))
    got = shard_indices((3, 2), p)
    full = slice(0, 2, 1)
    assert got[4] == ShardIndex((slice(0, 2, 1), full), 0)
    assert got[7] == ShardIndex((slice(0, 2, 1), full), 3)
    assert got[0] == ShardIndex((slice(2, 3, 1), full), 0)
    assert got[3] == ShardIndex((slice(2, 3, 1), full), 3)
    assert sorted(r for _, r in got.values()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_replica_ids_replicated_are_device_ids():
    p = plan(PERMUTED8, (2, 4), (None, None))
    got = shard_indices((3, 2), p)
    assert list(got) == list(PERMUTED8)
    assert all(index == ShardIndex(Ellipsis, d) for d, index in got.items())
    # A single replication group and a one-device mesh are replicated too.
    assert shard_indices((4,), plan(IDS8, (1, 8), (0,)))[6] == ShardIndex(Ellipsis, 6)
    assert shard_indices((4,), plan((3,), (1,), (0,))) == {3: ShardIndex(Ellipsis, 3)}


def test_replica_ids_tiled_are_zero():
    p = plan(IDS8, (8, 1), (0, None))  # Replication dim of 1: tiled.
    assert {r for _, r in shard_indices((8, 2), p).values()} == {0}


@pytest.mark.parametrize(
    "ids, mesh_shape, user_spec, shape",
    [
        (IDS8, (8,), (0,), (9,)),
        (PERMUTED8, (2, 4), (1, 0), (5, 3)),
        (REVERSED8, (2, 4), (None, 1), (2, 7)),
        (PERMUTED8, (2, 2, 2), ((2, 0), None), (7, 3)),
        (IDS8, (2, 1, 2, 2), ((3, 0), None, 2), (5, 1, 3)),
        (IDS8, (4, 2), (1, 0), (1, 1)),
    ],
)
def test_shards_cover_the_tensor_like_torch_padding(ids, mesh_shape, user_spec, shape):
    """Each shard of a padded torch tensor agrees with its clipped indices."""
    p = plan(ids, mesh_shape, user_spec)
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    padded_size = padded_shape(shape, p.tile_shape)
    padded = torch.full(padded_size, -1, dtype=tensor.dtype)
    padded[tuple(slice(0, n) for n in shape)] = tensor
    block = shard_shape(shape, p.tile_shape)
    coverage = torch.zeros(shape, dtype=torch.int64)
    got = shard_indices(shape, p)
    assignment = p.tile_assignment
    for position in np.ndindex(*assignment.shape):
        *tile, replica = position
        device = int(assignment[position])
        indices, replica_id = got[device]
        assert replica_id == replica
        shard = padded[tuple(slice(i * b, (i + 1) * b) for i, b in zip(tile, block))]
        assert tuple(shard.shape) == block
        real = tensor[indices]
        # The real data sits at the front of the shard; the rest is padding.
        assert torch.equal(shard[tuple(slice(0, n) for n in real.shape)], real)
        assert int((shard == -1).sum()) == shard.numel() - real.numel()
        coverage[indices] += 1
    assert torch.all(coverage == p.replicate_factor)


# --------------------------------------------------------------------------
# JAX bridge
# --------------------------------------------------------------------------


def test_to_jax_partition_spec():
    assert to_jax_partition_spec(((1,), None, (0, 2))) == P("axis_1", None, ("axis_0", "axis_2"))
    assert to_jax_partition_spec(((1,), None), NAMES) == P("model", None)
    assert to_jax_partition_spec(((1, 0),), NAMES) == P(("model", "data"))
    assert to_jax_partition_spec((None, None), NAMES) == P(None, None)
    assert to_jax_partition_spec((), NAMES) == P()
    with pytest.raises(ValueError, match="normalize_spec"):
        to_jax_partition_spec(("data",), NAMES)
    with pytest.raises(ValueError, match="not a mesh axis index"):
        to_jax_partition_spec(((2,),), NAMES)


def test_docstring_examples():
    result = doctest.testmod(spec_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
