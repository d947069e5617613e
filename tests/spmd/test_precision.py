"""16-bit float products over a sharded contracted dim equal eager CPU PyTorch bit for bit: the
SPMD partitioner sums each device's partial product in the dot's dtype, so xshard keeps the
product in float32 and rounds after the sum (see [Note: 16-bit products rounded once] in
xshard/core/lowering/linalg.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import xshard
import xshard.spmd as xs

DEV = xshard.device()
HALF = [torch.bfloat16, torch.float16]


def mesh():
    return xs.Mesh(np.arange(8), (8,), ("data",))


def _sharded(t, spec):
    d = t.to(DEV)
    xs.mark_sharding(d, mesh(), spec)
    return d


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("op", ["mm", "bmm", "matmul", "mv", "dot"])
def test_products_over_a_sharded_inner_dim(op, dtype):
    torch.manual_seed(0)
    shapes = {"mm": ((4, 64), (64, 4)), "bmm": ((2, 4, 64), (2, 64, 4)),
              "matmul": ((3, 4, 64), (64, 5)), "mv": ((4, 64), (64,)), "dot": ((64,), (64,))}
    a, b = (torch.randn(s).to(dtype) for s in shapes[op])
    fn = getattr(torch, op)
    want = fn(a, b)
    inner = lambda t, first: tuple("data" if i == (t.dim() - 1 if first else max(t.dim() - 2, 0))
                                   else None for i in range(t.dim()))
    got = fn(_sharded(a, inner(a, True)), _sharded(b, inner(b, False))).cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_linear_weight_gradient_over_a_sharded_batch(dtype):
    """The weight's gradient contracts the batch, sharded as in data parallelism."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 8).to(dtype), torch.randn(4, 8).to(dtype)
    grad = torch.randn(64, 4).to(dtype)
    want = torch.autograd.grad(F.linear(x, w.requires_grad_()), w, grad)[0]
    wd = w.detach().to(DEV).requires_grad_()
    out = F.linear(_sharded(x, ("data", None)), wd)
    got = torch.autograd.grad(out, wd, _sharded(grad, ("data", None)))[0].cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_convolution_over_sharded_input_channels():
    """bfloat16 (ATen's float16 convolution sums in an order of its own: unsharded, it differs
    from its float32 result rounded in a few elements, as xshard's does). The weight gradient
    over a sharded batch is differentiated in bfloat16 (README, Known limits)."""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    x, w = torch.randn(16, 32, 6, 6).to(dtype), torch.randn(4, 32, 3, 3).to(dtype)
    got = F.conv2d(_sharded(x, (None, "data", None, None)), _sharded(w, (None, "data", None, None)))
    torch.testing.assert_close(got.cpu(), F.conv2d(x, w), rtol=0, atol=0)


def test_muon_update_of_a_sharded_momentum():
    """torch.optim.Muon orthogonalises its momentum with bfloat16 Newton-Schulz iterations; FSDP
    shards a 32x16 weight's momentum by rows, and each product contracts the sharded dim."""
    ns = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
    torch.manual_seed(0)
    m = torch.randn(32, 16)
    coefficients = (3.4445, -4.775, 2.0315)
    want = ns(m, coefficients, 5, 1e-7)
    got = ns(_sharded(m, ("data", None)), coefficients, 5, 1e-7).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
