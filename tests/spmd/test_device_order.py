"""Meshes listing the devices in any order, or a subset of them (#10 item 5).

Eager CPU is the oracle; see [Note: one device assignment per graph] in xshard.core.placement.
"""

import numpy as np
import pytest
import torch

import xshard
import xshard.spmd as xs
from xshard import metrics
from xshard.core import placement

DEV = xshard.device()

REVERSED = xs.Mesh(np.arange(8)[::-1], (4, 2), ("x", "y"))
SUBSET = xs.Mesh(np.array([0, 1, 4, 5]), (2, 2), ("x", "y"))
PAIR = xs.Mesh(np.array([2, 3]), (2,), ("x",))
MESHES = {"reversed": REVERSED, "subset": SUBSET, "pair": PAIR}


def _data(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _spec(mesh):
    return ("x", "y") if mesh.ndim == 2 else ("x", None)


def _device_ids(t):
    return [d.id for d in xshard.core.api.array(t).sharding._device_assignment]


@pytest.mark.parametrize("name", MESHES)
def test_mark_sharding_on_default_placed_data(name):
    mesh = MESHES[name]
    a = _data(8, 4)
    x = a.to(DEV)
    xs.mark_sharding(x, mesh, _spec(mesh))
    assert _device_ids(x) == mesh.device_ids.tolist()
    torch.testing.assert_close(x.cpu(), a)


def test_the_sharding_string_follows_the_mesh_order():
    x = _data(8, 4).to(DEV)
    xs.mark_sharding(x, REVERSED, ("x", "y"))
    assert xs.get_sharding_spec(x) == "{devices=[4,2]7,6,5,4,3,2,1,0}"


@pytest.mark.parametrize("name", MESHES)
def test_compute_mixing_with_default_placed_tensors(name):
    """Data on the mesh, data on the default placement, pending values marked on the mesh:
    matmul, elementwise and reductions equal eager's."""
    mesh = MESHES[name]
    a, b, c = _data(8, 4, seed=1), _data(4, 6, seed=2), _data(8, 6, seed=3)
    x, y, z = a.to(DEV), b.to(DEV), c.to(DEV)
    xs.mark_sharding(x, mesh, _spec(mesh))
    w = x * 2 + 1  # pending, then marked: a sharding constraint inside the graph
    xs.mark_sharding(w, mesh, _spec(mesh))
    out = [x @ y, (w @ y + z).relu(), x.sum(0), (w * x).amax(-1), y.mean(), torch.cat([x, w], 1)]
    want = [a @ b, ((a * 2 + 1) @ b + c).relu(), a.sum(0), ((a * 2 + 1) * a).amax(-1), b.mean(),
            torch.cat([a, a * 2 + 1], 1)]
    for got, expected in zip(out, want):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.cpu(), a * 2 + 1)


@pytest.mark.parametrize("name", MESHES)
def test_default_placed_input_first(name):
    """The graph's first input is default-placed: jax reads XLA's result layouts against the
    first input's mesh, so it is re-viewed onto the mesh of the sharded data."""
    mesh = MESHES[name]
    a, b, c = _data(8, 4, seed=11), _data(6, 8, seed=12), _data(4, 8, seed=13)
    y, x, w = b.to(DEV), a.to(DEV), c.to(DEV)
    xs.mark_sharding(x, mesh, _spec(mesh))
    xs.mark_sharding(w, mesh, _spec(mesh)[::-1])
    torch.testing.assert_close((y @ x).cpu(), b @ a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((y @ x @ w).cpu(), b @ a @ c, rtol=1e-5, atol=1e-4)


def test_default_placed_inputs_after_the_first():
    """Every default-placed input is re-viewed onto the graph's mesh, not only the first: jax read
    the results' layouts against the 1-D mesh of the second input (a mask), which cannot express
    XLA's 2-D tiling (IndivisibleError at sync)."""
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
    a = torch.arange(24.).reshape(6, 4)
    mask = torch.tensor([True, False, False, False, False, False])[:, None]
    x = a.to(DEV)
    x.masked_fill_(mask.to(DEV), 3.0)
    total = x.sum(0)
    xs.mark_sharding(x, mesh, (None, "data"))
    expected = a.masked_fill(mask, 3.0)
    torch.testing.assert_close(total.cpu(), expected.sum(0))
    torch.testing.assert_close(x.cpu(), expected)


@pytest.mark.parametrize("op", ["where", "masked_fill"])
def test_default_placed_mask_with_data_sharded_over_the_default_devices(op):
    """Data sharded over a 2x4 mesh of devices 0..7 (the default devices, another mesh) and an
    unannotated mask: the mask is re-viewed onto that mesh too (IndivisibleError at sync)."""
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "model"))
    a, mask = torch.arange(8.), torch.tensor([True, False] * 4)
    x = a.to(DEV)
    xs.mark_sharding(x, mesh, ("data",))
    fn = (lambda m, t: torch.where(m, t, -t)) if op == "where" else (lambda m, t: t.masked_fill(m, 0.))
    torch.testing.assert_close(fn(mask.to(DEV), x).cpu(), fn(mask, a))


@pytest.mark.parametrize("first,second", [("subset", "reversed"), ("reversed", "subset"),
                                          ("subset", "pair"), ("pair", "reversed")])
def test_reshard_data_from_one_mesh_onto_another(first, second):
    a = _data(8, 4, seed=4)
    x = a.to(DEV)
    xs.mark_sharding(x, MESHES[first], _spec(MESHES[first]))
    xs.clear_sharding(x)
    assert xs.get_sharding_spec(x) == ""
    assert _device_ids(x) == list(range(8))  # back on the default placement
    torch.testing.assert_close(x.cpu(), a)
    xs.mark_sharding(x, MESHES[second], _spec(MESHES[second]))
    assert _device_ids(x) == MESHES[second].device_ids.tolist()
    torch.testing.assert_close((x + 1).cpu(), a + 1)


def test_mark_replicated_over_one_mesh_then_sharded_over_another():
    a = _data(8, 4, seed=14)
    x = a.to(DEV)
    xs.mark_sharding(x, SUBSET, (None, None))
    assert _device_ids(x) == [0, 1, 4, 5]
    xs.mark_sharding(x, REVERSED, ("x", "y"))  # a replicated annotation may be replaced
    assert _device_ids(x) == list(range(8))[::-1]
    assert xs.get_sharding_spec(x) == "{devices=[4,2]7,6,5,4,3,2,1,0}"
    torch.testing.assert_close(x.cpu(), a)


def test_data_on_two_different_meshes_in_one_computation():
    a, b = _data(8, 4, seed=5), _data(8, 4, seed=6)
    x, y = a.to(DEV), b.to(DEV)
    xs.mark_sharding(x, SUBSET, ("x", "y"))
    xs.mark_sharding(y, PAIR, ("x", None))
    torch.testing.assert_close((x + y).cpu(), a + b)
    torch.testing.assert_close((x @ y.T).sum().cpu(), (a @ b.T).sum(), rtol=1e-5, atol=1e-4)


def test_uneven_shards_over_a_reversed_mesh():
    a = _data(9, 3, seed=7)
    x = a.to(DEV)
    xs.mark_sharding(x, REVERSED, ("x", "y"))
    torch.testing.assert_close((x * 3).cpu(), a * 3)
    xs.clear_sharding(x)
    torch.testing.assert_close(x.cpu(), a)


def test_a_steady_loop_over_a_reversed_mesh_compiles_once():
    """Unannotated results come back on the default placement (not replicated in the mesh's
    order), so step 2 has step 1's input layouts and reuses its executable."""
    w = _data(4, 4, seed=8).to(DEV)
    xs.mark_sharding(w, REVERSED, ("x", "y"))
    acc = torch.zeros(8, 4, device=DEV)
    batch = _data(8, 4, seed=9).to(DEV)
    for _ in range(2):
        acc = acc + (batch @ w).tanh()
        xshard.sync()
    before = metrics.snapshot()["compiles"]
    for _ in range(3):
        acc = acc + (batch @ w).tanh()
        xshard.sync()
    assert metrics.snapshot()["compiles"] == before


def test_graph_constrained_over_two_device_orders_is_refused_clearly():
    x, y = _data(8, 4).to(DEV) * 1, _data(8, 4).to(DEV) * 1
    xs.mark_sharding(x, REVERSED, ("x", "y"))
    xs.mark_sharding(y, xs.Mesh(np.arange(8), (4, 2), ("x", "y")), ("x", "y"))
    with pytest.raises(placement.PlacementError,
                       match=r"different device lists: devices \[7, 6, .*devices \[0, 1, .*"
                             r"separate steps"):
        xshard.sync()
    del x, y


def test_local_shard_indices_are_lists_of_slices():
    a = _data(8, 4, seed=10)
    x = a.to(DEV)
    sharded = xs.mark_sharding(x, REVERSED, ("x", "y"))
    shards = sharded.local_shards
    assert [s.shard_device for s in shards] == [f"CPU:{i}" for i in range(8)]
    for shard in shards:
        assert isinstance(shard.indices, list)
        assert all(isinstance(s, slice) for s in shard.indices)
        torch.testing.assert_close(shard.data, a[tuple(shard.indices)])
    # device 7 is the mesh's first: it holds the top-left block
    assert shards[7].indices == [slice(0, 2, 1), slice(0, 2, 1)]
    replicated = xs.mark_sharding(_data(2, 2).to(DEV), REVERSED, (None, None))
    assert all(s.indices is Ellipsis for s in replicated.local_shards)
