"""A compiled step among xshard's other executions: its random draws are the lazy path's (the stream
is a host seed and counter, see [Note: random draws in a compiled step] in xshard/step/record.py),
its executable is named after the step function and timed in metrics, and multi-process runs check
it before every call with the numbers of that call."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import xshard
from compile_testing import DEV, MLP, make_batches
from xshard.core import divergence
from xshard.step import StateError


def two_draws(x):
    a = F.dropout(x, 0.5)
    return a, F.dropout(x * 2, 0.25)


def test_several_draws_per_call_and_the_stream_after_it():
    """Two draws per call: the same masks as the lazy path, call after call, and the stream left
    where the lazy path leaves it (get_rng_state equal)."""
    x = torch.ones(16, 8).to(DEV)
    step = xshard.compile(two_draws)
    runs = []
    for fn in (two_draws, step):
        torch.manual_seed(3)
        outs = [tuple(t.cpu() for t in fn(x)) for _ in range(3)]
        runs.append((outs, torch.xshard.get_rng_state()))
    (lazy, lazy_state), (comp, comp_state) = runs
    for (a, b), (c, d) in zip(lazy, comp):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not torch.equal(comp[0][0], comp[1][0])
    assert torch.equal(lazy_state, comp_state)
    assert step.traces == 1


def test_restored_rng_state_replays_the_draws():
    x = torch.ones(32, 8).to(DEV)
    drop = xshard.compile(lambda x: F.dropout(x, 0.5))
    torch.manual_seed(0)
    drop(x)
    state = torch.xshard.get_rng_state()
    first = drop(x).cpu()
    torch.xshard.set_rng_state(state)
    assert torch.equal(drop(x).cpu(), first)
    assert drop.traces == 1


def test_checkpoint_recomputes_with_the_forwards_masks():
    """torch.utils.checkpoint saves the stream before the forward and restores it to recompute in
    backward: inside a compiled step the recomputation draws the forward's masks (the gradient of
    sum(dropout(h) * h) is 2 * dropout(h) here, with h > 0), and equals the lazy path's."""
    torch.manual_seed(0)
    w0 = torch.rand(64, 16) + 0.5
    runs = []
    for compiled in (False, True):
        w = w0.clone().to(DEV).requires_grad_()

        def step(w=w):
            w.grad = None
            h = w * 1.0
            out = checkpoint(lambda h: F.dropout(h, 0.5) * h, h, use_reentrant=False)
            out.sum().backward()
            return out, w.grad

        fn = xshard.compile(step, state=w) if compiled else step  # w: a default argument
        torch.manual_seed(5)
        calls = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # w is state, not a constant
            for _ in range(3):
                out, grad = fn()
                calls.append((out.detach().cpu(), grad.cpu()))
        runs.append(calls)
    for (out, grad), (lazy_out, lazy_grad) in zip(runs[1], runs[0]):
        torch.testing.assert_close(grad, 2 * out / w0)
        assert torch.equal(out, lazy_out) and torch.equal(grad, lazy_grad)
    assert not torch.equal(runs[1][1][0], runs[1][2][0])  # a new mask each call
    assert fn.traces == 2 and fn.calls == 3  # .grad is None at the first call: the last replays


def test_seeding_inside_the_step_is_refused():
    x = torch.ones(4, 4).to(DEV)

    def seeded(x):
        torch.manual_seed(1)
        return F.dropout(x, 0.5)

    torch.manual_seed(0)
    before = torch.xshard.get_rng_state()
    with pytest.raises(StateError, match=r"seeded the device random stream .*Seed outside the "
                                         r"step"):
        xshard.compile(seeded)(x)
    assert torch.equal(torch.xshard.get_rng_state(), before)  # as it was, like the rest


def test_refused_recording_gives_its_draws_back():
    x = torch.ones(4, 4).to(DEV)

    def read_inside(x):
        y = F.dropout(x, 0.5)
        return y.sum().item()

    torch.manual_seed(0)
    before = torch.xshard.get_rng_state()
    with pytest.raises(xshard.step.CaptureError):
        xshard.compile(read_inside)(x)
    assert torch.equal(torch.xshard.get_rng_state(), before)


def test_executable_named_after_the_step_and_counted():
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=24).to(DEV)  # a program no other test compiles
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def my_train_step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = xshard.compile(my_train_step)
    data = [tuple(t.to(DEV) for t in b) for b in make_batches("mlp", 4)]
    step(*data[0])
    xshard.sync()
    before = xshard.metrics.metric_data("ExecuteTime")[0]
    for x, y in data[1:]:
        step(x, y)
    assert xshard.metrics.metric_data("ExecuteTime")[0] - before == 3
    assert "HloModule jit_xshard_my_train_step_" in step._last.compiled.as_text()


def test_checked_across_processes_before_each_call(monkeypatch):
    """With the multi-process check on, every call of the program is checked, with the numbers it
    runs on now (here the stream's counter, a new one each call; the same after reseeding)."""
    entries = []
    monkeypatch.setattr(divergence, "_enabled", lambda: True)
    monkeypatch.setattr(divergence, "_check",
                        lambda entry, describe, rebuild: entries.append(dict(entry)) or [entry])
    x = torch.ones(8, 12).to(DEV)  # shapes no other test compiles: a digest is computed
    drop = xshard.compile(lambda x: F.dropout(x * 3, 0.5))
    torch.manual_seed(0)
    for _ in range(3):
        drop(x)
    torch.manual_seed(0)
    drop(x)
    ours = [e for e in entries if e["k"] == "compiled step"]
    assert len(ours) == 4 and drop.traces == 1
    assert len({e["p"] for e in ours}) == 1 and ours[0]["p"] != "unknown"
    assert len({e["v"] for e in ours[:3]}) == 3
    assert ours[3]["v"] == ours[0]["v"]
