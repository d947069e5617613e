"""The device random stream: torch.manual_seed makes it reproducible; each draw and each step gets
fresh numbers from the same executable (seed and counter are graph inputs); recomputation under
activation checkpointing draws the forward's numbers; seeding never touches the devices."""

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


def _dropout_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 4)).to(DEV)


def _grads(block, x, run):
    torch.manual_seed(7)
    block.zero_grad()
    run(block, x).pow(2).sum().backward()
    return [p.grad.cpu() for p in block.parameters()]


@pytest.mark.parametrize("how", ["reentrant", "non_reentrant", "checkpoint_module"])
def test_checkpoint_recomputes_with_the_forward_masks(how):
    """A recomputation that drew new dropout masks would give other gradients (measured max error
    2.2 before PyTorch could save the device RNG state)."""
    from torch.utils.checkpoint import checkpoint

    from xshard.fsdp.utils import checkpoint_module

    x = torch.randn(8, 16).to(DEV)
    plain = _grads(_dropout_block(), x, lambda m, v: m(v))
    if how == "checkpoint_module":
        block = _dropout_block()
        checkpoint_module(block)
        got = _grads(block, x, lambda m, v: m(v))
    else:
        reentrant = how == "reentrant"
        got = _grads(_dropout_block(), x.requires_grad_(reentrant),
                     lambda m, v: checkpoint(m, v, use_reentrant=reentrant))
    for a, b in zip(plain, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # The masks are real: some gradient entries are exactly zero where the mask dropped a unit.
    assert (plain[0] == 0).any() and (plain[0] != 0).any()


def test_seeding_never_touches_the_devices(monkeypatch):
    """torch.manual_seed, xshard.manual_seed and the RNG state are host integers: no transfer,
    nothing compiled (so a forked DataLoader worker that seeds itself never calls into JAX)."""
    import jax

    def forbidden(*a, **k):
        raise AssertionError("seeding called into JAX")

    monkeypatch.setattr(jax, "device_put", forbidden)
    monkeypatch.setattr(jax, "jit", forbidden)
    with counting() as d:
        torch.manual_seed(3)
        xshard.manual_seed(4)
        state = torch.xshard.get_rng_state()
        torch.xshard.set_rng_state(state)
        torch.xshard.manual_seed_all(5)
    assert d["compiles"] == 0 and d["executions"] == 0
    assert state.dtype == torch.uint8 and state.numel() == 16


def test_rng_state_round_trip_replays_the_draws():
    torch.manual_seed(11)
    state = torch.xshard.get_rng_state()
    a = torch.rand(32, device=DEV).cpu()
    torch.xshard.set_rng_state(state)
    b = torch.rand(32, device=DEV).cpu()
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="16 bytes"):
        torch.xshard.set_rng_state(torch.zeros(8, dtype=torch.uint8))


def test_the_counter_wraps_as_a_uint64():
    """A state whose counter is the last uint64 (restored from anywhere): the next draws are at
    2**64 - 1 and then 0, as the state's 8 bytes say; the draw at 0 is the one a fresh seed makes."""
    torch.manual_seed(5)
    first = torch.rand(8, device=DEV).cpu()
    state = torch.xshard.get_rng_state()
    state[8:] = 255  # counter 2**64 - 1
    torch.xshard.set_rng_state(state)
    torch.rand(8, device=DEV).cpu()
    assert torch.equal(torch.rand(8, device=DEV).cpu(), first)
    assert torch.xshard.get_rng_state()[8:].tolist() == [1] + [0] * 7


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        import numpy as np

        noise = np.random.rand()  # seeded per worker by worker_init_fn
        return torch.full((4,), float(i * i)), torch.tensor(noise)


def _seed_worker(worker_id):
    import jax
    import numpy as np

    def forbidden(*a, **k):
        raise AssertionError("a forked worker called into JAX")

    jax.device_put = jax.jit = forbidden  # this child's copy of jax only
    np.random.seed(1000 + worker_id)
    torch.manual_seed(2000 + worker_id)


def test_forked_dataloader_workers_through_mp_device_loader():
    """Two forked workers, each seeding torch and numpy, feed MpDeviceLoader: the batches arrive
    on the device equal to the workers' CPU batches, and no worker calls into JAX after fork
    (each worker's seeding runs with JAX's entry points made to raise)."""
    import multiprocessing

    import xshard.spmd as xs

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork start method here")

    def loader():
        return torch.utils.data.DataLoader(_Squares(), batch_size=4, num_workers=2,
                                           worker_init_fn=_seed_worker,
                                           multiprocessing_context="fork")

    expected = [(a.clone(), b.clone()) for a, b in loader()]
    got = [(a.cpu(), b.cpu()) for a, b in xs.MpDeviceLoader(loader(), DEV)]
    assert len(got) == len(expected) == 4
    for (a, b), (ea, eb) in zip(got, expected):
        assert torch.equal(a, ea) and torch.equal(b, eb)
