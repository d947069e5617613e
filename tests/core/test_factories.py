"""Factories, transfers and reads: every dtype keeps its exact type and values; nothing runs early."""

import copy
import io

import pytest
import torch
import torch.nn as nn

import xshard
from core_testing import DEV, assert_same, counting

DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64, torch.float32,
          torch.bfloat16, torch.float16]


def sample(dtype, shape=(3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype is torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    if dtype in (torch.int32, torch.int64):
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def test_device_is_a_torch_device():
    assert isinstance(DEV, torch.device)
    assert DEV.type == "xshard"
    assert torch.zeros(1, device=DEV).device == DEV
    assert torch.zeros(1, device="xshard").device.type == "xshard"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_factories_keep_dtype(dtype):
    z = torch.zeros(2, 3, dtype=dtype, device=DEV)
    o = torch.ones(2, 3, dtype=dtype, device=DEV)
    f = torch.full((2, 3), 1 if dtype is torch.bool else 7, dtype=dtype, device=DEV)
    e = torch.empty(2, 3, dtype=dtype, device=DEV)
    assert (z.dtype, o.dtype, f.dtype, e.dtype) == (dtype,) * 4
    assert e.shape == (2, 3) and e.device == DEV
    assert_same(z, torch.zeros(2, 3, dtype=dtype))
    assert_same(o, torch.ones(2, 3, dtype=dtype))
    assert_same(f, torch.full((2, 3), 1 if dtype is torch.bool else 7, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_transfer_round_trip_is_exact(dtype):
    x = sample(dtype)
    d = x.to(DEV)
    assert d.dtype == dtype and d.device == DEV
    back = d.cpu()
    assert back.device.type == "cpu" and back.dtype == dtype
    assert torch.equal(back, x)
    assert torch.equal(torch.tensor(x.tolist(), dtype=dtype, device=DEV).cpu(), x)
    assert d.tolist() == x.tolist()
    assert d[1, 2].item() == x[1, 2].item()
    assert type(d[0, 0].item()) is type(x[0, 0].item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_factory(dtype):
    data = [[1, 0, 3], [4, 5, 0]]
    x = torch.tensor(data, dtype=dtype, device=DEV)
    assert_same(x, torch.tensor(data, dtype=dtype))


def test_transfer_copies_host_data():
    """A device tensor never aliases the host tensor it came from (JAX reads host buffers late)."""
    x = torch.zeros(1000)
    d = x.to(DEV)
    dst = torch.ones(1000, device=DEV)
    dst.copy_(x)
    s = torch.tensor(2.0)
    w = d + s
    x.add_(1)
    s.add_(1)
    assert_same(d, torch.zeros(1000))
    assert_same(dst, torch.zeros(1000))
    assert_same(w, torch.full((1000,), 2.0))
    back = d.cpu()
    back.add_(1)
    assert_same(d, torch.zeros(1000))


def test_tensor_factory_infers_dtype():
    assert_same(torch.tensor([1, 2], device=DEV), torch.tensor([1, 2]))
    assert_same(torch.tensor([1.5, 2], device=DEV), torch.tensor([1.5, 2]))
    assert_same(torch.tensor([True, False], device=DEV), torch.tensor([True, False]))
    assert_same(torch.tensor(3.25, device=DEV), torch.tensor(3.25))


def test_int64_beyond_int32_survives():
    big = [2**40 + 3, -(2**35) - 7, 2**62, 2**31]
    x = torch.tensor(big, device=DEV)
    assert x.dtype == torch.int64
    assert x.tolist() == big
    ref = torch.tensor(big)
    assert_same(x + 1, ref + 1)
    assert_same(x * 2, ref * 2)
    assert_same(x // 3, ref // 3)
    assert_same(x.sum(), ref.sum())
    assert_same(x.max(), ref.max())
    assert x[0].item() == 2**40 + 3
    assert_same(torch.full((2,), 2**33, device=DEV), torch.full((2,), 2**33))
    assert_same(torch.arange(2**32, 2**32 + 4, device=DEV), torch.arange(2**32, 2**32 + 4))


def test_float64_keeps_precision():
    x = torch.tensor([1.0 + 1e-12, 1e300], dtype=torch.float64)
    d = x.to(DEV)
    assert torch.equal(d.cpu(), x)
    assert_same(d * 3, x * 3)


@pytest.mark.parametrize("args,kwargs", [
    ((5,), {}), ((2, 9), {}), ((1, 2, 0.25), {}), ((0, 10, 3), {}), ((10, 0, -2), {}),
    ((5,), {"dtype": torch.float32}), ((0, 1, 0.1), {"dtype": torch.float64}),
    ((3,), {"dtype": torch.int32}), ((-4.5, 4.5), {}),
])
def test_arange(args, kwargs):
    assert_same(torch.arange(*args, **kwargs, device=DEV), torch.arange(*args, **kwargs))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("start,end", [(0, 1.2), (4.3, 0.0), (0.2, 6.8), (1.5, 1.5)])
@pytest.mark.parametrize("steps", [1, 2, 4, 7, 50])
def test_integer_linspace_and_logspace(dtype, start, end, steps):
    """Integer linspace / logspace cast their ends to the dtype first, as ATen does (xshard did
    not: ``logspace(0, 1.2, 4, base=5, dtype=int64)`` gave [1, 1, 3, 6], eager [1, 1, 2, 5])."""
    for fn, kwargs in ((torch.linspace, {}), (torch.logspace, {"base": 2.0})):
        assert_same(fn(start, end, steps, dtype=dtype, device=DEV, **kwargs),
                    fn(start, end, steps, dtype=dtype, **kwargs))


@pytest.mark.parametrize("args,kwargs", [((3,), {}), ((2, 4), {}), ((3,), {"dtype": torch.int64}),
                                         ((4, 2), {"dtype": torch.bool})])
def test_eye(args, kwargs):
    assert_same(torch.eye(*args, **kwargs, device=DEV), torch.eye(*args, **kwargs))


def test_random_factories_shapes_dtypes_ranges():
    torch.manual_seed(0)
    r = torch.rand(100, 50, device=DEV)
    n = torch.randn(100, 50, device=DEV, dtype=torch.float64)
    i = torch.randint(3, 10, (1000,), device=DEV)
    i32 = torch.randint(5, (10,), device=DEV, dtype=torch.int32)
    h = torch.rand(8, device=DEV, dtype=torch.bfloat16)
    assert (r.dtype, n.dtype, i.dtype, i32.dtype, h.dtype) == (
        torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16)
    rc, nc, ic = r.cpu(), n.cpu(), i.cpu()
    assert rc.shape == (100, 50) and 0 <= rc.min() and rc.max() < 1
    assert abs(rc.mean().item() - 0.5) < 0.02
    assert abs(nc.mean().item()) < 0.05 and abs(nc.std().item() - 1) < 0.05
    assert ic.min().item() >= 3 and ic.max().item() <= 9
    assert set(ic.tolist()) == set(range(3, 10))
    assert 0 <= i32.cpu().min() and i32.cpu().max() < 5


def test_factories_are_lazy():
    xshard.sync()
    with counting() as d:
        x = torch.ones(4, 4, device=DEV)
        y = torch.arange(16, device=DEV).view(4, 4)
        z = (x * y + torch.rand(4, 4, device=DEV)).sum(0)
    assert d["executions"] == 0 and d["compiles"] == 0
    with counting() as d:
        z.cpu()
    assert d["executions"] == 1


def test_like_factories_and_new_methods():
    x = torch.randn(2, 3).to(DEV)
    for fn in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.rand_like):
        y = fn(x)
        assert y.device == DEV and y.shape == (2, 3) and y.dtype == torch.float32
    assert_same(torch.full_like(x, 2.5), torch.full((2, 3), 2.5))
    assert_same(x.new_zeros(4), torch.zeros(4))
    assert_same(x.new_ones((2, 2), dtype=torch.int32), torch.ones(2, 2, dtype=torch.int32))
    assert_same(x.new_full((3,), 7.0), torch.full((3,), 7.0))
    assert_same(x.new_tensor([1, 2]), torch.randn(1).new_tensor([1, 2]))


def test_to_with_dtype_and_device():
    x = torch.randn(3, 4)
    assert_same(x.to(DEV, torch.float16), x.to(torch.float16))
    assert_same(x.to(DEV).to(torch.int32), x.to(torch.int32))
    assert_same(x.to(DEV).double(), x.double())
    back = x.to(DEV).to("cpu", torch.bfloat16)
    assert back.device.type == "cpu" and torch.equal(back, x.to(torch.bfloat16))
    d = x.to(DEV)
    assert d.to(DEV) is d


def test_model_to_device_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(DEV)
    for name, p in model.named_parameters():
        assert p.device == DEV and isinstance(p, nn.Parameter), name
        assert torch.equal(p.cpu(), ref[name])
    model.cpu()
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, ref[name])


def test_model_to_device_and_dtype():
    model = nn.Linear(3, 3).to(DEV, torch.float64)
    assert model.weight.dtype == torch.float64 and model.weight.device == DEV


def test_print_and_repr():
    x = torch.tensor([[1.5, 2.0], [3.0, -4.0]], device=DEV)
    text = repr(x)
    assert "device='xshard:0'" in text
    assert "1.5000" in text and "-4.0000" in text
    assert str(x) == text
    i = torch.tensor([1, 2**40], device=DEV)
    assert "1099511627776" in repr(i)
    p = torch.zeros(2, device=DEV).requires_grad_()
    assert "requires_grad=True" in repr(p)
    assert "device='xshard:0'" in repr(x[0])
    assert "xshard" in repr(torch.ones(2, dtype=torch.int32, device=DEV))


def test_item_and_scalar_conversion():
    x = torch.tensor([2.5, -1.0], device=DEV)
    assert x[0].item() == 2.5
    assert float(x[1]) == -1.0
    assert int(torch.tensor(7, device=DEV)) == 7
    assert bool(torch.tensor(True, device=DEV)) is True
    assert x.sum().item() == 1.5
    with pytest.raises(RuntimeError, match="2 elements cannot be converted to Scalar"):
        x.item()


def test_tensor_from_a_list_of_zero_dim_device_tensors():
    """torch.tensor / as_tensor read each 0-d tensor of a list with the Python key excluded
    (it raised NotImplementedError: no _local_scalar_dense kernel for the device)."""
    values = [torch.tensor(3, device=DEV), torch.tensor(4, device=DEV) * 2]
    for make in (torch.as_tensor, torch.tensor):
        out = make(values)
        assert out.tolist() == [3, 8] and out.dtype == torch.int64
    assert torch.as_tensor([2.5, torch.tensor(1.5, device=DEV)]).tolist() == [2.5, 1.5]


def test_torch_save_load_tensor_and_state_dict():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(DEV)
    t = torch.arange(6, device=DEV).view(2, 3)
    buf = io.BytesIO()
    torch.save({"t": t, "sd": model.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only, PyTorch's default
    assert loaded["t"].device == DEV and torch.equal(loaded["t"].cpu(), t.cpu())
    for k, v in model.state_dict().items():
        assert loaded["sd"][k].device == DEV
        assert torch.equal(loaded["sd"][k].cpu(), v.cpu())
    fresh = nn.Linear(4, 3).to(DEV)
    fresh.load_state_dict(loaded["sd"])
    assert torch.equal(fresh.weight.cpu(), model.weight.cpu())
    # A state dict saved from CPU loads into a device model.
    buf = io.BytesIO()
    torch.save(nn.Linear(4, 3).state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    assert fresh.weight.device == DEV


_LOAD_WITHOUT_XSHARD = """
import sys
sys.modules["xshard"] = None  # importing xshard now fails: the file must not need it
import torch
state = torch.load(sys.argv[1], map_location="cpu")  # weights_only, PyTorch's default
model, opt = state["model"], state["optim"]
assert all(t.device.type == "cpu" for t in model.values())
print(repr(model["weight"].tolist()))
print(repr(opt["state"][0]["exp_avg"].tolist()))
print(state["step"], model["weight"].dtype, state["bf16"].dtype)
"""


def test_saved_device_tensors_load_as_cpu_tensors_where_xshard_is_not_installed(tmp_path):
    """As a CUDA checkpoint does: torch.save of device tensors, state dicts and optimizer state
    writes PyTorch's own storage-less-device format, which weights_only loading accepts and
    map_location="cpu" turns into CPU tensors in a process without xshard."""
    import subprocess
    import sys

    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4).to(DEV)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 7,
                "bf16": torch.ones(2, dtype=torch.bfloat16, device=DEV)}, path)
    out = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_XSHARD, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    weight, exp_avg, rest = out.stdout.strip().split("\n")
    assert eval(weight) == model.weight.detach().cpu().tolist()
    assert eval(exp_avg) == opt.state_dict()["state"][0]["exp_avg"].cpu().tolist()
    assert rest == "7 torch.float32 torch.bfloat16"
    # With xshard present, the same file loads onto the device, and onto the CPU on request.
    on_device = torch.load(path)
    assert on_device["model"]["weight"].device == DEV
    assert torch.load(path, map_location="cpu")["model"]["weight"].device.type == "cpu"


def test_deepcopy_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(DEV)
    clone = copy.deepcopy(model)
    for (name, a), b in zip(model.state_dict().items(), clone.state_dict().values()):
        assert b.device == DEV, name
        assert torch.equal(a.cpu(), b.cpu()), name
    assert isinstance(clone[0].weight, nn.Parameter) and clone[0].weight.requires_grad
    with torch.no_grad():
        clone[0].weight.add_(1)
    assert not torch.equal(model[0].weight.cpu(), clone[0].weight.cpu())


def test_type_promotion_matches_eager():
    pairs = [
        (torch.int32, torch.float16), (torch.uint8, torch.int32), (torch.bool, torch.int64),
        (torch.bfloat16, torch.float16), (torch.float32, torch.float64), (torch.uint8, torch.bool),
        (torch.int64, torch.float32), (torch.bfloat16, torch.int64),
    ]
    for a_dt, b_dt in pairs:
        a, b = sample(a_dt, (3, 1), 1), sample(b_dt, (1, 4), 2)
        assert_same(a.to(DEV) + b.to(DEV), a + b)
        assert_same(a.to(DEV) * b.to(DEV), a * b)


def test_scalar_and_zero_dim_promotion():
    i = torch.tensor([1, 2, 3], dtype=torch.int32)
    h = torch.tensor([1.5, 2.5], dtype=torch.float16)
    u = torch.tensor([250, 3], dtype=torch.uint8)
    di, dh, du = i.to(DEV), h.to(DEV), u.to(DEV)
    assert_same(di + 1, i + 1)
    assert_same(di + 1.5, i + 1.5)
    assert_same(di / 2, i / 2)
    assert_same(dh * 3.0, h * 3.0)
    assert_same(du + 10, u + 10)  # wraps, stays uint8
    assert_same(di + torch.tensor(2.5, dtype=torch.float64).to(DEV),
                i + torch.tensor(2.5, dtype=torch.float64))
    assert_same(dh + torch.tensor(1, dtype=torch.int64).to(DEV), h + torch.tensor(1))
    assert_same(di > 1, i > 1)
    assert_same(dh + True, h + True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.bool])
def test_integers_computed_in_float_convert_each_operand_from_its_own_dtype(dtype):
    # True division, atan2, copysign, xlogy: ATen converts each operand to float directly; the
    # number -1 must not pass through the promoted integer dtype (uint8: 255) first.
    x = torch.tensor([1, 0, 1], dtype=dtype)
    dx = x.to(DEV)
    minus_one = torch.tensor(-1)
    for op in (lambda a: a / -1, lambda a: torch.div(a, 300), lambda a: -1 / a,
               lambda a: torch.true_divide(a, -2), lambda a: a / minus_one.to(a.device),
               lambda a: torch.atan2(a, minus_one.to(a.device)), lambda a: torch.copysign(a, -1),
               lambda a: torch.xlogy(a, -1), lambda a: torch.xlogy(-1, a),
               lambda a: torch.special.xlog1py(a, -2)):
        assert_same(op(dx), op(x))


def test_broadcasting_matches_eager():
    a, b, c = torch.randn(4, 1, 3), torch.randn(5, 1), torch.randn(3)
    assert_same(a.to(DEV) + b.to(DEV), a + b)
    assert_same(a.to(DEV) * c.to(DEV) - b.to(DEV).unsqueeze(-1)[:4], a * c - b.unsqueeze(-1)[:4])
    assert_same(torch.where(a.to(DEV) > 0, b.to(DEV), 0.0), torch.where(a > 0, b, 0.0))
