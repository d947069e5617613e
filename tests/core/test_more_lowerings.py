"""Ops that ran on the CPU fallback (and so refused xshard.compile): weight normalisation's
backward, the matrix exponential, ``nn.Embedding(max_norm=)``'s renormalisation and
``torch.multinomial``. Each now runs on the device, against eager CPU PyTorch; the random one is
checked by its distribution."""

import copy

import pytest
import torch
import torch.nn as nn

import xshard
from core_testing import DEV, assert_same, counting


def _no_fallback(delta):
    assert delta["cpu_fallbacks"] == {}, delta["cpu_fallbacks"]


@pytest.mark.parametrize("dim", [0, -1, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_weight_norm_training(dim, dtype):
    """``nn.utils.parametrizations.weight_norm`` forward and backward (``_weight_norm_interface``
    and its backward for dims 0 and last, a decomposition for the others)."""
    torch.manual_seed(0)
    cpu = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 5, 3), dim=dim).to(dtype)
    dev = copy.deepcopy(cpu).to(DEV)
    x = torch.randn(2, 3, 7, dtype=dtype)
    expected = cpu(x).square().sum()
    expected.backward()
    with counting() as delta:
        loss = dev(x.to(DEV)).square().sum()
        loss.backward()
        xshard.sync()
    _no_fallback(delta)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert_same(loss, expected.detach(), **tol)
    for (name, a), (_, b) in zip(dev.named_parameters(), cpu.named_parameters()):
        assert_same(a.grad, b.grad, **tol), name


def _train(make_model, make_optimizer, loss_of, inputs, device, compiled):
    """Losses and parameters (on CPU) after one training step per input, eagerly or under
    xshard.compile."""
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = make_optimizer(model.parameters())

    def step(x):
        loss = loss_of(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = xshard.compile(step) if compiled else step
    losses = [fn(x.to(device)).item() for x in inputs]
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_weight_norm_compiled_step():
    """A training step of a weight-normalised model under xshard.compile (it refused the step:
    no lowering for the backward), equal to eager over a few steps."""
    def model():
        return nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(6, 8)), nn.Tanh(),
                             nn.utils.parametrizations.weight_norm(nn.Linear(8, 2)))

    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 6, generator=g) for _ in range(4)]
    run = [_train(model, lambda p: torch.optim.Adam(p, lr=1e-2), lambda y: y.square().mean(),
                  inputs, device, compiled) for device, compiled in (("cpu", False), (DEV, True))]
    (la, pa), (lb, pb) = run
    assert lb == pytest.approx(la, rel=1e-5)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matrix_exp_and_gradient(dtype):
    torch.manual_seed(0)
    a = torch.randn(3, 4, 4, dtype=dtype) * 0.7
    a[1] *= 5  # a norm that needs squaring
    expected = torch.linalg.matrix_exp(a.clone().requires_grad_())
    weights = torch.randn(3, 4, 4, dtype=dtype)
    leaf = a.clone().requires_grad_()
    (torch.linalg.matrix_exp(leaf) * weights).sum().backward()
    with counting() as delta:
        d = a.to(DEV).requires_grad_()
        out = torch.linalg.matrix_exp(d)
        (out * weights.to(DEV)).sum().backward()
        xshard.sync()
    _no_fallback(delta)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    assert_same(out, expected.detach(), **tol)
    assert_same(d.grad, leaf.grad, **tol)


@pytest.mark.parametrize("norm_type,dtype", [(2.0, torch.float32), (1.0, torch.float32),
                                              (2.0, torch.bfloat16)])
def test_embedding_max_norm(norm_type, dtype):
    """``nn.Embedding(max_norm=)`` renormalises, in place, the rows its input names (each once)
    whose norm exceeds ``max_norm``; the rows it does not name keep theirs."""
    torch.manual_seed(0)
    cpu = nn.Embedding(10, 4, max_norm=1.0, norm_type=norm_type).to(dtype)
    with torch.no_grad():
        cpu.weight.mul_(3)
        cpu.weight[7] *= 0.05  # a named row under the limit
    dev = copy.deepcopy(cpu).to(DEV)
    idx = torch.tensor([[1, 2, 2], [7, 9, 1]])
    expected = cpu(idx)
    (expected * torch.arange(4.0, dtype=dtype)).sum().backward()
    with counting() as delta:
        out = dev(idx.to(DEV))
        (out * torch.arange(4.0, dtype=dtype).to(DEV)).sum().backward()
        xshard.sync()
    _no_fallback(delta)
    assert_same(out, expected.detach(), rtol=1e-6, atol=1e-6)
    assert_same(dev.weight.detach(), cpu.weight.detach(), rtol=1e-6, atol=1e-6)
    assert_same(dev.weight.grad, cpu.weight.grad)


def test_embedding_max_norm_compiled():
    def model():
        return nn.Sequential(nn.Embedding(12, 4, max_norm=0.5), nn.Flatten(), nn.Linear(8, 1))

    g = torch.Generator().manual_seed(2)
    inputs = [torch.randint(0, 12, (5, 2), generator=g) for _ in range(4)]
    run = [_train(model, lambda p: torch.optim.SGD(p, lr=0.5), lambda y: y.square().sum(),
                  inputs, device, compiled) for device, compiled in (("cpu", False), (DEV, True))]
    (la, (wa, *_)), (lb, (wb, *_)) = run
    assert lb == pytest.approx(la, rel=1e-5)
    torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)


def test_multinomial_distribution():
    """With replacement: each category's frequency matches its weight (weights need not sum to
    one); a weight of 0 is never drawn. Without: the draws of a row are distinct, and a single
    draw without replacement is distributed as one with."""
    torch.manual_seed(0)
    weights = torch.tensor([[1.0, 2.0, 0.0, 5.0], [0.0, 0.0, 3.0, 1.0]])
    n = 20000
    with counting() as delta:
        draws = torch.multinomial(weights.to(DEV), n, replacement=True)
        single = torch.multinomial(weights.repeat(2000, 1).to(DEV), 1)  # rows 2k and 2k + 1
        distinct = torch.multinomial(torch.rand(64, 6).add(0.1).to(DEV), 4)
        xshard.sync()
    _no_fallback(delta)
    assert draws.dtype == torch.int64 and draws.shape == (2, n)
    p = weights / weights.sum(-1, keepdim=True)
    freq = torch.stack([torch.bincount(r, minlength=4) for r in draws.cpu()]).double() / n
    torch.testing.assert_close(freq, p.double(), atol=0.015, rtol=0)
    assert (freq[p == 0] == 0).all()
    rows = single.cpu().reshape(2000, 2).T
    freq1 = torch.stack([torch.bincount(r, minlength=4) for r in rows]).double() / 2000
    torch.testing.assert_close(freq1, p.double(), atol=0.04, rtol=0)
    d = distinct.cpu()
    assert d.shape == (64, 4)
    assert all(len(set(row.tolist())) == 4 for row in d)
    one_d = torch.multinomial(torch.tensor([0.0, 1.0, 0.0]).to(DEV), 3, replacement=True)
    assert one_d.cpu().tolist() == [1, 1, 1]
    # Two calls draw differently (each draws from the stream).
    a, b = (torch.multinomial(torch.ones(50).to(DEV), 10).cpu() for _ in range(2))
    assert not torch.equal(a, b)
