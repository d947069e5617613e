"""mark_sharding and friends on 8 virtual CPU devices: values against eager CPU PyTorch, the exact
sharding strings, shard geometry, HLO, and every user error."""

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
import xshard.spmd as xs
from xshard.spmd.api import ShardingAnnotationError

DEV = xshard.device()
COLLECTIVES = re.compile(
    r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\b")


def mesh_2d():
    return xs.Mesh(np.arange(8), (4, 2), ("data", "model"))


def mesh_1d():
    return xs.Mesh(np.arange(8), (8,), ("d",))


def collectives(tensors) -> set:
    return set(COLLECTIVES.findall(xshard.debug.compiled_hlo_text(tensors)))


def pending(*shape):
    """A device tensor whose value is still a pending node (marking it compiles nothing)."""
    return torch.zeros(*shape, device=DEV)


def compiles() -> int:
    return xshard.metrics.snapshot()["compiles"]


# -- values: sharded programs equal the unsharded eager result ------------------------------------


def test_matmul_chain_equals_cpu():
    torch.manual_seed(0)
    mesh = mesh_2d()
    a, w1, w2 = torch.randn(16, 32), torch.randn(32, 64), torch.randn(64, 8)
    ad, w1d, w2d = a.to(DEV), w1.to(DEV), w2.to(DEV)
    xs.mark_sharding(ad, mesh, ("data", None))
    xs.mark_sharding(w1d, mesh, (None, "model"))
    xs.mark_sharding(w2d, mesh, ("model", None))
    out = torch.relu(ad @ w1d) @ w2d
    torch.testing.assert_close(out.cpu(), torch.relu(a @ w1) @ w2, rtol=1e-4, atol=1e-4)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def megatron(model, mesh):
    # Column-parallel then row-parallel: the hidden activation is split over 'model'.
    xs.mark_sharding(model.fc1.weight, mesh, ("model", None))
    xs.mark_sharding(model.fc1.bias, mesh, ("model",))
    xs.mark_sharding(model.fc2.weight, mesh, (None, "model"))


@pytest.mark.parametrize("make_opt,state_key", [
    (lambda p: torch.optim.AdamW(p, lr=1e-2), "exp_avg"),
    (lambda p: torch.optim.SGD(p, lr=1e-1, momentum=0.9), "momentum_buffer"),
], ids=["adamw", "sgd_momentum"])
def test_mlp_training_equals_cpu_keeps_shardings_and_compiles_once(make_opt, state_key):
    torch.manual_seed(0)
    mesh = mesh_2d()
    ref = MLP()
    model = copy.deepcopy(ref).to(DEV)
    megatron(model, mesh)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    compiles_after = []
    for _ in range(4):
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        xd = x.to(DEV)
        xs.mark_sharding(xd, mesh, ("data", None))
        loss = F.mse_loss(model(xd), y.to(DEV))
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-4, atol=1e-5)
        compiles_after.append(compiles())
    # The first step creates the optimizer state; from then on every step reuses one executable.
    assert compiles_after[1] == compiles_after[2] == compiles_after[3]
    for p, rp in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), rp.detach(), rtol=1e-4, atol=1e-5)
    col = "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    row = "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    assert xs.get_sharding_spec(model.fc1.weight) == col
    assert xs.get_sharding_spec(model.fc2.weight) == row
    assert xs.get_sharding_spec(opt.state[model.fc1.weight][state_key]) == col
    assert xs.get_sharding_spec(opt.state[model.fc2.weight][state_key]) == row
    assert xs.get_sharding_spec(opt.state[model.fc1.bias][state_key]) == \
        "{devices=[2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"


def test_conv_with_spatially_sharded_input_equals_cpu():
    torch.manual_seed(0)
    mesh = xs.Mesh(np.arange(8), (2, 2, 2), ("data", "x", "y"))
    x, w = torch.randn(4, 3, 16, 16), torch.randn(8, 3, 3, 3, requires_grad=True)
    xd = x.to(DEV)
    xs.mark_sharding(xd, mesh, ("data", None, "x", "y"))
    wd = w.detach().to(DEV).requires_grad_()
    out = F.conv2d(xd, wd, padding=1)
    # The halo of each spatial block comes from its neighbours.
    assert "collective-permute" in collectives([out])
    out.relu().sum().backward()
    ref = F.conv2d(x, w, padding=1)
    ref.relu().sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wd.grad.cpu(), w.grad, rtol=1e-4, atol=1e-3)


# -- sharding strings ------------------------------------------------------------------------------

IDS = np.arange(8)
REVERSED = np.arange(8)[::-1].copy()


@pytest.mark.parametrize("ids,mesh_shape,names,shape,spec,expected", [
    (IDS, (8,), None, (16,), (0,), "{devices=[8]0,1,2,3,4,5,6,7}"),
    (IDS, (2, 4), None, (8, 8), (0, 1), "{devices=[2,4]0,1,2,3,4,5,6,7}"),
    # Specs ordered differently from the mesh transpose the device grid.
    (IDS, (2, 4), None, (8, 8), (1, 0), "{devices=[4,2]0,4,1,5,2,6,3,7}"),
    (IDS, (2, 4), None, (8, 8), (0, None),
     "{devices=[2,1,4]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"),
    (IDS, (2, 4), None, (8, 8), (None, 1),
     "{devices=[1,4,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"),
    (IDS, (4, 2), ("data", "model"), (8, 8), ("model", None),
     "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"),
    (IDS, (4, 2), ("data", "model"), (8, 8), ("data", "model"), "{devices=[4,2]0,1,2,3,4,5,6,7}"),
    (IDS, (4, 2), ("data", "model"), (8, 8), ("model", "data"), "{devices=[2,4]0,2,4,6,1,3,5,7}"),
    # Tuple specs: several mesh axes on one dimension, major first.
    (IDS, (2, 4), ("a", "b"), (8, 8), (("a", "b"), None), "{devices=[8,1]0,1,2,3,4,5,6,7}"),
    (IDS, (2, 4), ("a", "b"), (8, 8), (("b", "a"), None), "{devices=[8,1]0,4,1,5,2,6,3,7}"),
    (IDS, (2, 4), None, (8, 8), (None, (1, 0)), "{devices=[1,8]0,4,1,5,2,6,3,7}"),
    # Custom device order: the string lists device ids, replication groups sorted.
    (REVERSED, (2, 4), None, (8, 8), (0, 1), "{devices=[2,4]7,6,5,4,3,2,1,0}"),
    (REVERSED, (2, 4), None, (8, 8), (None, 1),
     "{devices=[1,4,2]3,7,2,6,1,5,0,4 last_tile_dim_replicate}"),
    (np.array([0, 2, 4, 6, 1, 3, 5, 7]), (8,), None, (8,), (0,), "{devices=[8]0,2,4,6,1,3,5,7}"),
    # 4-D meshes.
    (IDS, (2, 2, 1, 2), ("a", "b", "c", "d"), (2, 2, 2, 2), ("a", "b", "c", "d"),
     "{devices=[2,2,1,2]0,1,2,3,4,5,6,7}"),
    (IDS, (2, 2, 1, 2), ("a", "b", "c", "d"), (2, 2, 2, 2), ("d", None, "b", "a"),
     "{devices=[2,1,2,2]0,4,2,6,1,5,3,7}"),
    (IDS, (2, 2, 1, 2), ("a", "b", "c", "d"), (2, 2, 2, 2), (None, "b", None, None),
     "{devices=[1,2,1,1,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate}"),
    # Trivial replication is dropped; a single replication group is {replicated}.
    (IDS, (8, 1), None, (8, 8), (0, None), "{devices=[8,1]0,1,2,3,4,5,6,7}"),
    (IDS, (1, 8), None, (8, 8), (0, None), "{replicated}"),
    (IDS, (4, 2), ("data", "model"), (8, 8), (None, None), "{replicated}"),
])
def test_sharding_strings(ids, mesh_shape, names, shape, spec, expected):
    mesh = xs.Mesh(ids, mesh_shape, names)
    t = pending(*shape)
    sharded = xs.mark_sharding(t, mesh, spec)
    assert xs.get_sharding_spec(t) == expected
    assert sharded.sharding_spec == expected


@pytest.mark.parametrize("spec,kind", [
    (("data", "model"), xs.ShardingType.TILED),
    (("data", None), xs.ShardingType.PARTIAL),
    ((None, None), xs.ShardingType.REPLICATED),
])
def test_sharding_type(spec, kind):
    t = pending(8, 8)
    assert xs.get_sharding_type(t) is None
    assert xs.get_sharding_spec(t) == ""
    assert xs.mark_sharding(t, mesh_2d(), spec).sharding_type == kind
    assert xs.get_sharding_type(t) == kind


def test_sharding_spec_same_for_device_data_and_pending_value():
    mesh = mesh_2d()
    data = torch.randn(8, 8).to(DEV)
    xshard.sync()
    xs.mark_sharding(data, mesh, ("model", "data"))
    assert data._cell.value.is_data  # resharded now, not at the next sync
    assert xs.get_sharding_spec(data) == xs.get_sharding_spec(
        xs.mark_sharding(pending(8, 8), mesh, ("model", "data")).global_tensor)


def test_sync_results_carry_xlas_sharding():
    mesh = mesh_1d()
    x = torch.randn(16, 4).to(DEV)
    xs.mark_sharding(x, mesh, ("d", None))
    y = x * 2 + 1
    assert xs.get_sharding_spec(y) == ""  # pending, unannotated
    xshard.sync()
    assert xs.get_sharding_spec(y) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    assert xs.get_sharding_type(y) == xs.ShardingType.TILED


# -- XLAShardedTensor and local shards -------------------------------------------------------------


def test_sharded_tensor_wrapper():
    mesh = mesh_2d()
    x = torch.arange(32.).reshape(8, 4)
    xd = x.to(DEV)
    st = xs.mark_sharding(xd, mesh, ("data", "model"))
    assert isinstance(st, xs.XLAShardedTensor)
    assert st.global_tensor is xd
    assert st.sharding_type == xs.ShardingType.TILED
    torch.testing.assert_close((st + 1).cpu(), x + 1)
    assert "XLAShardedTensor(" in repr(st) and "sharding_spec='{devices=[4,2]" in repr(st)
    assert xs.wrap_if_sharded(xd).sharding_spec == st.sharding_spec
    assert xs.wrap_if_sharded(3) == 3


def test_local_shards_uneven_rows_are_padded():
    x = torch.arange(36.).reshape(9, 4)
    xd = x.to(DEV)
    shards = xs.mark_sharding(xd, mesh_1d(), ("d", None)).local_shards
    assert [s.shard_device for s in shards] == [f"CPU:{i}" for i in range(8)]
    assert all(tuple(s.data.shape) == (2, 4) for s in shards)
    assert [s.replica_id for s in shards] == [0] * 8
    assert shards[0].indices == [slice(0, 2, 1), slice(0, 4, 1)]
    assert shards[4].indices == [slice(8, 9, 1), slice(0, 4, 1)]
    assert shards[5].indices == [slice(9, 9, 1), slice(0, 4, 1)]
    assert tuple(shards[4].unpadded_data.shape) == (1, 4)
    torch.testing.assert_close(shards[4].data, torch.cat([x[8:], torch.zeros(1, 4)]))
    torch.testing.assert_close(shards[7].data, torch.zeros(2, 4))
    torch.testing.assert_close(torch.cat([s.unpadded_data for s in shards]), x)
    assert tuple(xd.shape) == (9, 4)
    torch.testing.assert_close(xd.cpu(), x)


def test_local_shards_partial_replication():
    x = torch.arange(32.).reshape(8, 4)
    shards = xs.mark_sharding(x.to(DEV), mesh_2d(), ("model", None)).local_shards
    # {devices=[2,1,4]0,2,4,6,1,3,5,7}: even devices hold rows 0:4, odd ones rows 4:8.
    for s in shards:
        device = int(s.shard_device.split(":")[1])
        assert s.indices == [slice(4 * (device % 2), 4 * (device % 2) + 4, 1), slice(0, 4, 1)]
        assert s.replica_id == device // 2
        torch.testing.assert_close(s.data, x[tuple(s.indices)])


def test_local_shards_replicated():
    x = torch.randn(3, 5)
    shards = xs.mark_sharding(x.to(DEV), mesh_2d(), (None, None)).local_shards
    assert [s.indices for s in shards] == [Ellipsis] * 8
    assert [s.replica_id for s in shards] == list(range(8))
    for s in shards:
        torch.testing.assert_close(s.data, x)


def test_load_local_shards_round_trip():
    x = torch.arange(36.).reshape(9, 4)
    st = xs.mark_sharding(x.to(DEV), mesh_1d(), ("d", None))
    shards = st.local_shards
    for s in shards:
        s.unpadded_data = s.unpadded_data * 10
    st.load_local_shards_(shards)
    torch.testing.assert_close(st.global_tensor.cpu(), x * 10)
    assert xs.get_sharding_spec(st.global_tensor) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close((st.global_tensor + 1).cpu(), x * 10 + 1)


def test_load_local_shards_errors():
    st = xs.mark_sharding(torch.zeros(8, 4).to(DEV), mesh_1d(), ("d", None))
    shards = st.local_shards
    with pytest.raises(RuntimeError, match=r"got 7 shards, the tensor has 8"):
        st.load_local_shards_(shards[:7])
    shards[3].data = torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match=r"shard for CPU:3 has shape \(2, 4\).*\(1, 4\)"):
        st.load_local_shards_(shards)
    rep = xs.mark_sharding(torch.zeros(8, 4).to(DEV), mesh_1d(), (None, None))
    with pytest.raises(RuntimeError, match="needs a sharded tensor; this one is replicated"):
        rep.load_local_shards_(rep.local_shards)


# -- uneven dimensions through ops -----------------------------------------------------------------


def test_uneven_dims_through_ops():
    torch.manual_seed(0)
    mesh = mesh_2d()
    x, w = torch.randn(9, 5), torch.randn(5, 3)
    xd, wd = x.to(DEV), w.to(DEV)
    xs.mark_sharding(xd, mesh, ("data", "model"))
    xs.mark_sharding(wd, mesh, ("model", None))
    y = (xd * 2 + 1) @ wd
    s = xd.sum(1)
    xs.mark_sharding(y, mesh, ("data", None))
    xd.add_(1)  # in place on an uneven sharded tensor
    xshard.sync()
    assert tuple(y.shape) == (9, 3) and tuple(xd.shape) == (9, 5)
    assert xs.get_sharding_spec(xd) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close(y.cpu(), (x * 2 + 1) @ w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s.cpu(), x.sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xd.cpu(), x + 1)
    # ... and into the next graph (sliced back to the logical shape).
    torch.testing.assert_close((xd * xd).sum().cpu(), ((x + 1) ** 2).sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [9, 16], ids=["uneven", "even"])
def test_max_and_min_over_a_sharded_dim_keep_nan(n):
    """The all-reduce XLA's partitioner adds for a max or min over a sharded dim drops a NaN on
    the CPU backend, with the rest of that device's elements: max gave 8.0 and min 2.0 for
    [0, nan, 2, ..., 8] over 8 devices, where eager gives NaN."""
    x = torch.arange(float(n)).reshape(1, n).repeat(2, 1)
    x[0, 1] = float("nan")
    xd = x.to(DEV)
    xs.mark_sharding(xd, mesh_1d(), (None, "d"))
    checks = [lambda t: t.amax(), lambda t: t.amin(), lambda t: t.max(), lambda t: t.min(),
              lambda t: t.amax(1), lambda t: t.amin(1, keepdim=True), lambda t: t.max(1).values,
              lambda t: t.min(1).values, lambda t: t.max(1).indices,
              lambda t: torch.linalg.vector_norm(t, float("inf"), dim=1),
              lambda t: torch.linalg.vector_norm(t, float("-inf"))]
    for check in checks:
        torch.testing.assert_close(check(xd).cpu(), check(x), equal_nan=True)


@pytest.mark.parametrize("case", ["2-D", "1-D", "padding beyond the kernel"])
def test_transposed_conv_over_a_sharded_spatial_dim(case):
    """XLA's partitioner computed a convolution dilating both its input and its kernel wrongly
    over a sharded spatial dim (values 100 off), or aborted the process, in plain JAX too; it
    aborted the process on a strided transposed convolution padded beyond its kernel's reach (a
    negative pad: kernel 1, padding 1)."""
    torch.manual_seed(0)
    if case == "2-D":
        x, w, spec = torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 5), ("data", None, None, "model")
        kw = dict(stride=(3, 2), padding=(1, 2), output_padding=(2, 3), groups=2, dilation=4)
        conv = F.conv_transpose2d
    elif case == "1-D":
        x, w, spec = torch.randn(1, 2, 4), torch.randn(2, 2, 3), (None, None, "model")
        kw, conv = dict(stride=2, dilation=4, output_padding=2), F.conv_transpose1d
    else:
        x, w, spec = torch.randn(1, 2, 4), torch.randn(2, 2, 1), (None, None, "model")
        kw, conv = dict(stride=2, padding=1), F.conv_transpose1d

    def run(device):
        xd, wd = x.to(device), w.to(device)
        if device is DEV:
            xs.mark_sharding(xd, mesh_2d(), spec)
        xd.requires_grad_(), wd.requires_grad_()
        out = conv(xd, wd, **kw)
        out.backward(torch.ones_like(out))
        return [out.detach().cpu(), xd.grad.cpu(), wd.grad.cpu()]

    for a, b in zip(run(DEV), run("cpu")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- HLO -------------------------------------------------------------------------------------------


def test_hlo_shows_sharding_attributes():
    mesh = mesh_2d()
    a = torch.randn(8, 16).to(DEV)
    xs.mark_sharding(a, mesh, ("data", None))
    b = a * 2
    xs.mark_sharding(b, mesh, ("data", "model"))  # a pending value: a constraint
    hlo = xshard.debug.hlo_text([b])
    assert re.search(r"parameter\(0\), sharding=\{devices=\[4,1,2\]", hlo)
    assert re.search(r'custom_call_target="Sharding", sharding=\{devices=\[4,2\]', hlo)
    stablehlo = xshard.debug.stablehlo_text([b])  # Shardy attributes
    assert 'sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>' in stablehlo
    assert re.search(r'sdy.sharding_constraint %\d+ <@mesh, \[\{"data"\}, \{"model"\}\]>',
                     stablehlo)


def test_compiled_hlo_shows_collectives():
    mesh = mesh_1d()
    a = torch.randn(16, 16).to(DEV)
    xs.mark_sharding(a, mesh, ("d", None))
    assert "all-reduce" in collectives([a.sum(0)])
    assert "all-gather" in collectives([a @ a])
    assert "collective-permute" in collectives([torch.roll(a, 1, 0)])
    b = a * 2
    xs.mark_sharding(b, mesh, (None, "d"))
    assert "all-to-all" in collectives([b])
    scatter = xs.shard_map(lambda t: xs.reduce_scatter(t, 1, "d", mesh=mesh), mesh,
                           in_specs=(("d", None),), out_specs=(None, "d"))
    assert "reduce-scatter" in collectives([scatter(a)])
    assert collectives([a * 3]) == set()  # elementwise: nothing to communicate


# -- annotations survive ---------------------------------------------------------------------------


def test_annotation_survives_sync_clone_deepcopy_and_inplace():
    mesh = mesh_2d()
    spec = "{devices=[4,2]0,1,2,3,4,5,6,7}"
    x = torch.randn(8, 8)
    t = x.to(DEV)
    xs.mark_sharding(t, mesh, ("data", "model"))
    t.mul_(2)
    t[0] = 1.0  # a write through a view
    assert xs.get_sharding_spec(t) == spec
    xshard.sync()
    assert xs.get_sharding_spec(t) == spec
    c, d = t.clone(), copy.deepcopy(t)
    assert xs.get_sharding_spec(c) == spec and xs.get_sharding_spec(d) == spec
    expected = x * 2
    expected[0] = 1.0
    torch.testing.assert_close(d.cpu(), expected)
    xshard.sync()
    assert xs.get_sharding_spec(c) == spec


def test_module_deepcopy_keeps_parameter_shardings():
    model = MLP().to(DEV)
    megatron(model, mesh_2d())
    clone = copy.deepcopy(model)
    assert xs.get_sharding_spec(clone.fc1.weight) == xs.get_sharding_spec(model.fc1.weight) != ""


def test_mark_sharding_with_gradients_shards_the_gradient():
    mesh = mesh_2d()
    x = torch.randn(8, 16)
    p = x.to(DEV).requires_grad_()
    q = xs.mark_sharding_with_gradients(p, mesh, ("data", "model"))
    assert xs.get_sharding_spec(p) == ""  # not in place
    assert xs.get_sharding_spec(q) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    (q * q).sum().backward()
    xshard.sync()
    assert xs.get_sharding_spec(p.grad) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close(p.grad.cpu(), 2 * x)


# -- re-marking ------------------------------------------------------------------------------------


def test_remark_rules():
    mesh = mesh_2d()
    t = torch.zeros(8, 8).to(DEV)
    xs.mark_sharding(t, mesh, ("data", None))
    value = t._cell.value
    xs.mark_sharding(t, mesh, (0, None))  # the same spec, written differently: a no-op
    assert t._cell.value is value
    with pytest.raises(RuntimeError, match="Existing annotation must be cleared first"):
        xs.mark_sharding(t, mesh, (None, "model"))
    assert xs.clear_sharding(t) is t
    assert xs.get_sharding_spec(t) == "" and xs.get_sharding_type(t) is None
    xs.mark_sharding(t, mesh, (None, "model"))
    assert xs.get_sharding_spec(t) == "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"
    r = pending(8, 8)
    xs.mark_sharding(r, mesh, (None, None))
    xs.mark_sharding(r, mesh, ("data", "model"))  # a replicated tensor may be re-marked
    assert xs.get_sharding_spec(r) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    torch.testing.assert_close(t.cpu(), torch.zeros(8, 8))


def test_clear_sharding_of_pending_value_drops_its_constraint():
    mesh = mesh_1d()
    t = pending(8, 8) + 1
    xs.mark_sharding(t, mesh, ("d", None))
    xs.clear_sharding(t)
    assert "Sharding" not in xshard.debug.hlo_text([t])
    torch.testing.assert_close(t.cpu(), torch.ones(8, 8))


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,message", [
    (("data",), r"has 1 entries, but the tensor has rank 2; the mesh axes are \('data', 'model'\)"),
    (("data", None, None), r"has 3 entries, but the tensor has rank 2"),
    (("batch", None), r"names mesh axis 'batch' at dimension 0, but the mesh axes are "
                      r"\('data', 'model'\)"),
    (("data", "data"), r"uses mesh axis 'data' \(index 0\) at dimensions 0 and 1"),
    (("data", ("model", "data")), r"mesh axis 'data' \(index 0\) at dimensions 0 and 1"),
    ((2, None), r"uses mesh axis index 2 at dimension 0, but the mesh has 2 axes"),
    ((-1, None), r"mesh axis index -1"),
    (((("data",),), None), r"nests \('data',\) inside the tuple at dimension 0"),
    ((1.0, None), r"has 1.0 of type float at dimension 0"),
])
def test_bad_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        xs.mark_sharding(pending(8, 8), mesh_2d(), spec)


def test_bad_tensors():
    mesh = mesh_2d()
    with pytest.raises(TypeError, match=r"needs a tensor on the xshard device, got cpu. Move it"):
        xs.mark_sharding(torch.zeros(8, 8), mesh, ("data", None))
    base = torch.zeros(8, 8).to(DEV)
    with pytest.raises(ValueError, match=r"this tensor \(shape \(4, 8\)\) is a view of another"):
        xs.mark_sharding(base[:4], mesh, ("data", None))
    with pytest.raises(TypeError, match="mesh must be an xshard.spmd.Mesh, got tuple"):
        xs.mark_sharding(base, (4, 2), ("data", None))
    with pytest.raises(TypeError, match="get_sharding_spec needs a tensor on the xshard device"):
        xs.get_sharding_spec(torch.zeros(2))


def test_default_placed_data_copied_to_a_sub_mesh_once(monkeypatch):
    """Unannotated data read together with data on a sub-mesh is laid out on the sub-mesh's
    devices once, not every step (kept with the data), and without a copy: its replicas on those
    devices are re-viewed (see [Note: one device assignment per graph])."""
    from xshard.core import api as core_api
    from xshard.core import arrays, placement

    calls, copies = [], []
    onto, replicate = placement.onto, arrays.replicated_on
    monkeypatch.setattr(placement, "onto", lambda *a: calls.append(1) or onto(*a))
    monkeypatch.setattr(arrays, "replicated_on", lambda *a: copies.append(1) or replicate(*a))
    sub = xs.Mesh(np.arange(4), (4,), ("x",))
    a = torch.ones(8, 4, device=xshard.device())
    xs.mark_sharding(a, sub, ("x", None))
    b = torch.randn(8, 4).to(xshard.device())  # replicated over all 8 devices
    xshard.sync()
    for step in range(3):
        torch.testing.assert_close((a * b * step).cpu(), step * b.cpu())
    assert len(calls) == 1 and not copies
    placed = core_api.value(b).placed[1]
    assert sorted(d.id for d in placed.sharding.device_set) == [0, 1, 2, 3]
    source = core_api.array(b).addressable_shards
    buffers = {s.device: s.data.unsafe_buffer_pointer() for s in source}
    assert all(s.data.unsafe_buffer_pointer() == buffers[s.device]
               for s in placed.addressable_shards)


@pytest.mark.parametrize("spec", [(None, "model"), ("data", None), (None, ("data", "model"))])
def test_empty_tensor_sharded_unevenly_reads_back(spec):
    """A zero-sized tensor sharded on a dim that does not divide (5 over 2 or 8): reading it
    raised numpy's broadcast error from assembling the padded shards."""
    x = torch.zeros(0, 5)
    d = x.to(DEV)
    xs.mark_sharding(d, mesh_2d(), spec)
    got = (d + 1).cpu()
    assert got.shape == (0, 5) and got.dtype == torch.float32
    assert d.cpu().shape == (0, 5)
