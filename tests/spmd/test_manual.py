"""Manual sharding regions and collectives: each result equals the unsharded CPU computation."""

import numpy as np
import pytest
import torch

import xshard
import xshard.spmd as xs

DEV = xshard.device()


@pytest.fixture(scope="module")
def mesh():
    return xs.Mesh(np.arange(8), (4, 2), ("data", "model"))


def region(x, mesh, spec, body, out_spec, full_shape):
    local = xs.enable_manual_sharding(x, spec, mesh=mesh)
    return xs.disable_manual_sharding(body(local), out_spec, full_shape, mesh=mesh)


def test_enter_exit_and_manual_spec(mesh):
    x = torch.randn(8, 6)
    local = xs.enable_manual_sharding(x.to(DEV), ("data", "model"), mesh=mesh)
    assert tuple(local.shape) == (2, 3)
    assert xs.get_sharding_spec(local) == "{manual}"
    assert xs.get_sharding_type(local) == xs.ShardingType.MANUAL
    out = xs.disable_manual_sharding(local * 2, ("data", "model"), (8, 6), mesh=mesh)
    assert xs.get_sharding_spec(out) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close(out.cpu(), x * 2)


@pytest.mark.parametrize("op,ref", [
    ("sum", lambda b: b.sum(0)), ("mean", lambda b: b.mean(0)),
    ("max", lambda b: b.amax(0)), ("min", lambda b: b.amin(0)),
])
def test_all_reduce(mesh, op, ref):
    x = torch.randn(8, 6)
    out = region(x.to(DEV), mesh, ("data", None),
                 lambda t: xs.all_reduce(t, "data", op, mesh=mesh), (None, None), (2, 6))
    # Every device ends with the reduction of the 4 row blocks.
    torch.testing.assert_close(out.cpu(), ref(x.reshape(4, 2, 6)), rtol=1e-5, atol=1e-5)


def test_all_reduce_over_one_axis_of_two(mesh):
    x = torch.randn(8, 6)
    out = region(x.to(DEV), mesh, ("data", "model"),
                 lambda t: xs.all_reduce(t, "model", mesh=mesh), ("data", None), (8, 3))
    torch.testing.assert_close(out.cpu(), x[:, :3] + x[:, 3:], rtol=1e-5, atol=1e-5)


def test_all_reduce_over_both_axes_global_mesh(mesh):
    x = torch.randn(8, 6)
    xs.set_global_mesh(mesh)
    try:
        total = xs.shard_map(lambda t: xs.all_reduce(t.sum(), ("data", "model")), mesh,
                             in_specs=(("data", "model"),), out_specs=())(x.to(DEV))
    finally:
        xs.set_global_mesh(None)
    torch.testing.assert_close(total.cpu(), x.sum(), rtol=1e-5, atol=1e-5)


def test_all_gather(mesh):
    x = torch.randn(8, 6)
    out = region(x.to(DEV), mesh, ("data", "model"),
                 lambda t: xs.all_gather(t, 0, "data", mesh=mesh), (None, "model"), (8, 6))
    torch.testing.assert_close(out.cpu(), x)


def test_reduce_scatter(mesh):
    x = torch.randn(8, 8)
    # Each 'data' row block is summed, and 'data' device i keeps column block i of the sum.
    out = region(x.to(DEV), mesh, ("data", None),
                 lambda t: xs.reduce_scatter(t, 1, "data", mesh=mesh), (None, "data"), (2, 8))
    torch.testing.assert_close(out.cpu(), x.reshape(4, 2, 8).sum(0), rtol=1e-5, atol=1e-5)


def test_all_to_all(mesh):
    x = torch.randn(8, 8)
    # Column-split in, row-split out: a transpose of the layout, the same global value.
    out = region(x.to(DEV), mesh, (None, "data"),
                 lambda t: xs.all_to_all(t, 0, 1, "data", mesh=mesh), ("data", None), (8, 8))
    torch.testing.assert_close(out.cpu(), x)


def test_ppermute(mesh):
    x = torch.randn(8, 6)
    shift = [(i, (i + 1) % 4) for i in range(4)]
    out = region(x.to(DEV), mesh, ("data", None),
                 lambda t: xs.ppermute(t, "data", shift, mesh=mesh), ("data", None), (8, 6))
    torch.testing.assert_close(out.cpu(), torch.roll(x, 2, 0))
    # Devices that receive nothing get zeros.
    out = region(x.to(DEV), mesh, ("data", None),
                 lambda t: xs.ppermute(t, "data", [(0, 1)], mesh=mesh), ("data", None), (8, 6))
    expected = torch.zeros(8, 6)
    expected[2:4] = x[0:2]
    torch.testing.assert_close(out.cpu(), expected)


def test_uneven_region(mesh):
    x = torch.randn(9, 5)
    local = xs.enable_manual_sharding(x.to(DEV), ("data", "model"), mesh=mesh)
    assert tuple(local.shape) == (3, 3)  # ceil(9 / 4), ceil(5 / 2)
    out = xs.disable_manual_sharding(local * 3 - 1, ("data", "model"), (9, 5), mesh=mesh)
    assert tuple(out.shape) == (9, 5)
    torch.testing.assert_close(out.cpu(), x * 3 - 1)
    # The padding is zeros: a sum over the padded blocks is the sum of the real rows.
    total = region(x.to(DEV), mesh, ("data", None),
                   lambda t: xs.all_reduce(t.sum(0, keepdim=True), "data", mesh=mesh),
                   (None, None), (1, 5))
    torch.testing.assert_close(total.cpu(), x.sum(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_shard_map_multiple_outputs_and_inputs(mesh):
    x, w = torch.randn(8, 6), torch.randn(6, 4)

    def body(xl, wl):
        y = xl @ wl  # a row block of x times all of w
        return y, xs.all_reduce(y.sum(0), "data", mesh=mesh)

    f = xs.shard_map(body, mesh, in_specs=(("data", None), (None, None)),
                     out_specs=(("data", None), (None,)))
    y, colsum = f(x.to(DEV), w.to(DEV))
    assert tuple(y.shape) == (8, 4) and tuple(colsum.shape) == (4,)
    torch.testing.assert_close(y.cpu(), x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(colsum.cpu(), (x @ w).sum(0), rtol=1e-4, atol=1e-4)
    # The results are ordinary global tensors.
    torch.testing.assert_close((y * 2).sum().cpu(), 2 * (x @ w).sum(), rtol=1e-4, atol=1e-4)


def test_region_result_feeds_later_graphs(mesh):
    x = torch.randn(8, 6)
    out = region(x.to(DEV), mesh, ("data", None), lambda t: t + 1, ("data", None), (8, 6))
    xshard.sync()
    torch.testing.assert_close((out @ out.t()).cpu(), (x + 1) @ (x + 1).t(), rtol=1e-4, atol=1e-4)


# -- errors ----------------------------------------------------------------------------------------


def test_collective_outside_region(mesh):
    with pytest.raises(RuntimeError, match=r"xs.all_reduce runs inside a manual sharding region"):
        xs.all_reduce(torch.zeros(4, device=DEV), "data", mesh=mesh)


def test_reading_a_manual_tensor(mesh):
    local = xs.enable_manual_sharding(torch.zeros(8, 6).to(DEV), ("data", None), mesh=mesh)
    with pytest.raises(RuntimeError, match="holds per-device shards inside a manual sharding"):
        local.cpu()


def test_grad_requiring_input(mesh):
    x = torch.zeros(8, 6).to(DEV).requires_grad_()
    with pytest.raises(RuntimeError, match="manual sharding regions are not differentiable"):
        xs.enable_manual_sharding(x, ("data", None), mesh=mesh)
    with torch.no_grad():
        xs.enable_manual_sharding(x, ("data", None), mesh=mesh)


def test_region_argument_errors(mesh):
    x = torch.zeros(8, 6).to(DEV)
    local = xs.enable_manual_sharding(x, ("data", None), mesh=mesh)
    with pytest.raises(ValueError, match=r"a shard of \(8, 6\) split by \('data', None\) has shape "
                                         r"\(2, 6\), but the tensor has shape \(2, 3\)"):
        xs.disable_manual_sharding(local[:, :3], ("data", None), (8, 6), mesh=mesh)
    with pytest.raises(ValueError, match="reduce_op='prod'; choose one of"):
        xs.all_reduce(local, "data", "prod", mesh=mesh)
    with pytest.raises(ValueError, match="No mesh given and no global mesh set"):
        xs.enable_manual_sharding(x, ("data", None))
    with pytest.raises(ValueError, match="shard_map got 2 inputs for 1 in_specs"):
        xs.shard_map(lambda t: t, mesh, in_specs=(("data", None),), out_specs=("data", None))(x, x)
    # As jax.shard_map: fn saw the padding of the last shards, and its results kept it (a (7,)
    # input gave an (8,) result; a max over the padding's zeros was 0 for negative values).
    with pytest.raises(ValueError, match=r"input 0 \(shape \[7, 6\]\) has dim 0 of size 7 split 4 "
                                         r"ways .* pad that dim to a multiple of 4"):
        xs.shard_map(lambda t: t * 2, mesh, in_specs=(("data", None),),
                     out_specs=("data", None))(x[:7])
    with pytest.raises(ValueError, match="does not divide into 4 blocks"):
        xs.reduce_scatter(local, 0, "data", mesh=mesh)
