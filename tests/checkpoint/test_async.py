"""xshard.checkpoint.async_save: returns once the state is on the host, writes it while training goes
on, and the checkpoint holds the state at the call; DCP's own async_save refuses xshard tensors
with its default stager (it saved uninitialised memory)."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager

import xshard.checkpoint as xcp

from tests.checkpoint.checkpoint_testing import (adamw, assert_same, batches, fsdp_gpt, mesh,
                                                 model_state, on_device, snapshot, train)


def _state(model, opt, step):
    grid = on_device(torch.arange(60.0).reshape(6, 10) / 7, mesh((2, 4), ("a", "b")), ("a", "b"))
    return {"model": model, "optim": opt, "step": step, "extra": {"grid": grid, "note": ["a"]}}


def _values(state):
    return {"model": model_state(state["model"]), "optim": snapshot(state["optim"].state_dict()),
            "extra": snapshot(state["extra"]), "step": state["step"]}


def test_the_checkpoint_holds_the_state_at_the_call(tmp_path):
    data = batches(4)
    model = fsdp_gpt(seed=3)
    opt = adamw(model)
    train(model, opt, data[:2])
    state = _state(model, opt, 2)
    expected = _values(state)
    pending = xcp.async_save(state, tmp_path / "ckpt")
    state["extra"]["note"].append("b")  # changed after the call: not saved
    state["extra"]["grid"].mul_(2)
    continued = train(model, opt, data[2:])
    assert pending.result() is None
    fresh = fsdp_gpt(seed=9)
    fresh_opt = adamw(fresh)
    loaded = {"model": fresh, "optim": fresh_opt, "step": 0,
              "extra": {"grid": on_device(torch.zeros(6, 10)), "note": []}}
    xcp.load(loaded, tmp_path / "ckpt")
    assert_same(_values(loaded), expected)
    assert train(fresh, fresh_opt, data[2:]) == continued


def test_python_values_are_pickled_at_the_call(tmp_path):
    """A device tensor inside a value DCP pickles whole (a tuple) is read at the call, not on the
    background thread, and saved as it was then."""
    a = on_device(torch.arange(4.0), mesh(), ("x",))
    pending = xcp.async_save({"pair": (a, a * 2)}, tmp_path / "ckpt")
    a.mul_(10)
    pending.result()
    out = {"pair": None}
    xcp.load(out, tmp_path / "ckpt")
    assert [t.tolist() for t in out["pair"]] == [[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]]


def test_saves_one_at_a_time_and_keep_save_s_checks(tmp_path):
    t = on_device(torch.arange(8.0), mesh(), ("x",))
    first = xcp.async_save({"t": t}, tmp_path / "a")
    second = xcp.async_save({"t": t * 2}, tmp_path / "b")  # waits for the first
    assert first.done()
    second.result()
    with pytest.raises(xcp.CheckpointError, match="already exists"):
        xcp.async_save({"t": t}, tmp_path / "a")
    xcp.async_save({"t": t * 3}, tmp_path / "a", overwrite=True).result()
    for name, factor in (("a", 3), ("b", 2)):
        out = {"t": torch.zeros(8)}
        xcp.load(out, tmp_path / name)
        assert torch.equal(out["t"], torch.arange(8.0) * factor)


def test_a_failed_write_raises_from_the_future_and_warns(tmp_path, monkeypatch):
    """A write failing on the background thread: result() raises, a warning says so for a caller
    that never asks, nothing is committed, and the next save works. A value that cannot be
    pickled is refused at the call, naming its key."""
    state = {"t": on_device(torch.ones(4)), "fn": lambda: 0}
    with pytest.raises(xcp.CheckpointError, match="Key 'fn': the value \\(function\\) cannot "
                                                 "be pickled"):
        xcp.async_save(state, tmp_path / "ckpt")
    del state["fn"]

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", full_disk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pending = xcp.async_save(state, tmp_path / "ckpt")
        with pytest.raises(xcp.CheckpointError, match="nothing was committed"):
            pending.result()
    assert any("async_save failed" in str(w.message) for w in caught)
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.undo()
    xcp.async_save(state, tmp_path / "ckpt").result()
    out = {"t": torch.zeros(4)}
    xcp.load(out, tmp_path / "ckpt")
    assert torch.equal(out["t"], torch.ones(4))


def test_dcp_async_save_refuses_the_default_stager(tmp_path):
    """DCP's default stager took an xshard tensor for a wrapper of inner tensors and saved an
    uninitialised CPU tensor; the blocking stager copies with copy_, which works."""
    a = on_device(torch.randn(9, 6), mesh(), ("x", None))
    for planner in (None, xcp.SavePlanner()):
        with pytest.raises(RuntimeError, match="xshard.checkpoint.async_save"):
            dcp.async_save({"a": a}, checkpoint_id=tmp_path / "dcp", planner=planner)
    dcp.async_save({"a": a}, checkpoint_id=tmp_path / "blocking", planner=xcp.SavePlanner(),
                   async_stager=BlockingAsyncStager()).result()
    out = {"a": torch.zeros(9, 6)}
    dcp.load(out, checkpoint_id=tmp_path / "blocking")
    assert torch.equal(out["a"], a.cpu())
