"""The device random stream: torch.manual_seed makes it reproducible; each draw and each step gets
fresh numbers from the same executable (the key is device data threaded through the graph)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import xshard
from core_testing import DEV, counting

DRAWS = {
    "rand": lambda: torch.rand(64, device=DEV),
    "randn": lambda: torch.randn(8, 8, device=DEV),
    "randint": lambda: torch.randint(0, 1000, (64,), device=DEV),
    "randperm": lambda: torch.randperm(20, device=DEV),
    "rand_like": lambda: torch.rand_like(torch.zeros(16, device=DEV)),
    "uniform_": lambda: torch.empty(32, device=DEV).uniform_(-2, 2),
    "normal_": lambda: torch.empty(32, device=DEV).normal_(3, 0.5),
    "bernoulli": lambda: torch.bernoulli(torch.full((64,), 0.5, device=DEV)),
    "dropout": lambda: F.dropout(torch.ones(64, device=DEV), 0.5, training=True),
}


@pytest.mark.parametrize("name", list(DRAWS))
def test_manual_seed_reproduces_stream(name):
    draw = DRAWS[name]
    torch.manual_seed(123)
    a1, a2 = draw().cpu(), draw().cpu()
    torch.manual_seed(123)
    b1, b2 = draw().cpu(), draw().cpu()
    torch.manual_seed(124)
    c1 = draw().cpu()
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    assert not torch.equal(a1, a2), "consecutive draws must differ"
    assert not torch.equal(a1, c1), "another seed gives another stream"


def test_stream_independent_of_sync_points():
    """Where the syncs fall does not change the numbers drawn."""
    torch.manual_seed(7)
    a = [torch.rand(4, device=DEV) for _ in range(3)]
    xshard.sync()
    torch.manual_seed(7)
    b = []
    for _ in range(3):
        b.append(torch.rand(4, device=DEV))
        xshard.sync()
    for x, y in zip(a, b):
        assert torch.equal(x.cpu(), y.cpu())


def test_xshard_manual_seed_and_initial_seed():
    xshard.manual_seed(5)
    a = torch.randn(6, device=DEV).cpu()
    torch.manual_seed(5)
    b = torch.randn(6, device=DEV).cpu()
    assert torch.equal(a, b)
    assert torch.xshard.initial_seed() == 5


def test_distributions():
    torch.manual_seed(0)
    u = torch.rand(20000, device=DEV).cpu()
    n = torch.randn(20000, device=DEV).cpu()
    b = torch.bernoulli(torch.full((20000,), 0.3, device=DEV)).cpu()
    p = torch.randperm(50, device=DEV).cpu()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert abs(n.mean()) < 0.03 and abs(n.std() - 1) < 0.03
    assert abs(b.mean() - 0.3) < 0.02 and set(b.unique().tolist()) <= {0.0, 1.0}
    assert sorted(p.tolist()) == list(range(50))


def test_dropout_new_mask_each_step_without_recompiling():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: only the mask varies
    x = torch.ones(4, 8, device=DEV)
    xshard.sync()
    masks, compiles = [], []
    for _ in range(4):
        with counting() as d:
            hidden = model[1](model[0](x))
            model[2](hidden).sum().backward()
            opt.step()
            opt.zero_grad()
            xshard.sync()
        compiles.append(d["compiles"])
        masks.append((hidden.detach().cpu() != 0))
    assert compiles[1:] == [0, 0, 0]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    scaled = hidden.detach().cpu()
    kept = scaled[masks[-1]]
    expected = (model[0](x) * 2).detach().cpu()[masks[-1]]
    torch.testing.assert_close(kept, expected)  # kept units are scaled by 1/(1-p)
    ratio = torch.stack(masks).float().mean().item()
    assert 0.35 < ratio < 0.65
    # eval mode: no dropout, deterministic
    model.eval()
    assert torch.equal(model(x).cpu(), model(x).cpu())


def test_generator_argument_is_rejected_with_hint():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match="manual_seed"):
        torch.rand(3, device=DEV, generator=g).cpu()
