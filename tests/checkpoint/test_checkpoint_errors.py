"""Bad checkpoints and bad states: clear errors naming the key and both shapes, and nothing half
loaded; a save killed part-way leaves nothing that loads as a checkpoint."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import xshard
import xshard.checkpoint as xcp
from xshard.checkpoint import CheckpointError, CheckpointNotFoundError
from xshard.core import runtime

from tests.checkpoint.checkpoint_testing import (assert_same, mesh, on_device, run_script,
                                                 snapshot, spec_of)

SAVED = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.randn(9, 5), "step": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("errors") / "ckpt"
    xcp.save({"model": {"a": on_device(SAVED["a"]),
                        "b": on_device(SAVED["b"], mesh(), ("x", None))},
              "step": SAVED["step"]}, path)
    return path


def fresh_state(**model_overrides):
    """A state whose values differ from the checkpoint's, so a partial load would show."""
    model = {"a": on_device(torch.full((3, 4), -1.0), mesh((4, 2), ("p", "q")), ("p", "q")),
             "b": on_device(torch.full((9, 5), -2.0), mesh(), (None, "x"))}
    model.update(model_overrides)
    return {"model": model, "step": 0}


def on_xshard(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "xshard"


def load_fails(state, path, error=CheckpointError, match=None):
    """Loads, expecting ``error``; checks that ``state`` is unchanged, shardings included."""
    before = snapshot(state)
    specs = {k: spec_of(v) for k, v in state["model"].items() if on_xshard(v)}
    with pytest.raises(error, match=match) as info:
        xcp.load(state, path)
    assert_same(state, before)
    assert {k: spec_of(v) for k, v in state["model"].items() if on_xshard(v)} == specs
    return info.value


def test_the_fixture_loads(checkpoint):
    state = fresh_state()
    xcp.load(state, checkpoint)
    assert_same(state, {"model": {"a": SAVED["a"], "b": SAVED["b"]}, "step": 4})


def test_missing_path(tmp_path):
    load_fails(fresh_state(), tmp_path / "nowhere", CheckpointNotFoundError,
               match=r"No checkpoint at .*nowhere: the directory does not exist")
    with pytest.raises(FileNotFoundError):  # also a FileNotFoundError, for generic handlers
        xcp.load(fresh_state(), tmp_path / "nowhere")


def test_path_is_a_file(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"not a checkpoint")
    load_fails(fresh_state(), tmp_path / "model.pt", CheckpointNotFoundError,
               match=r"model\.pt is a file, not a checkpoint directory")


def test_directory_without_metadata(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "__0_0.distcp").write_bytes(b"\0" * 16)
    load_fails(fresh_state(), tmp_path / "ckpt", CheckpointNotFoundError,
               match=r"ckpt is not a complete checkpoint: it has no \.metadata file")


def test_key_missing_from_the_checkpoint(checkpoint):
    error = load_fails(fresh_state(c=on_device(torch.zeros(2))), checkpoint,
                       match=r"Key 'model\.c' of the state to load into is not in the checkpoint")
    assert error.key == "model.c" and error.found is None


def test_wrong_global_shape(checkpoint):
    error = load_fails(
        fresh_state(b=on_device(torch.zeros(9, 6), mesh(), ("x", None))), checkpoint,
        match=r"Key 'model\.b': the checkpoint holds a tensor of shape \(9, 5\) and dtype "
              r"torch\.float32; the state to load into has a tensor of shape \(9, 6\) and dtype "
              r"torch\.float32\. A checkpoint loads onto any mesh")
    assert error.key == "model.b"
    assert error.expected == ((9, 6), torch.float32) and error.found == ((9, 5), torch.float32)


def test_wrong_dtype(checkpoint):
    load_fails(fresh_state(a=on_device(torch.zeros(3, 4, dtype=torch.bfloat16))), checkpoint,
               match=r"Key 'model\.a': the checkpoint holds a tensor of shape \(3, 4\) and dtype "
                     r"torch\.float32; the state to load into has a tensor of shape \(3, 4\) and "
                     r"dtype torch\.bfloat16")


def test_several_problems_name_the_first_and_count_the_rest(checkpoint):
    load_fails(fresh_state(a=on_device(torch.zeros(2, 2)), c=torch.zeros(1)), checkpoint,
               match=r"Key 'model\.a'.*\(1 more problems, e\.g\. with keys \['model\.c'\]\.\)")


def test_tensor_where_the_checkpoint_has_a_value_and_the_reverse(checkpoint):
    state = fresh_state()
    state["step"] = torch.zeros(())
    load_fails(state, checkpoint, match=r"Key 'step': the checkpoint holds a Python value, not a "
                                        r"tensor; the state to load into holds a tensor of shape")
    load_fails(fresh_state(b="weights"), checkpoint,
               match=r"Key 'model\.b': the checkpoint holds a tensor of shape \(9, 5\) and dtype "
                     r"torch\.float32; the state to load into holds a str value")


def test_entries_the_state_lacks(checkpoint):
    state = fresh_state()
    del state["model"]["b"]
    load_fails(state, checkpoint, match=r"The checkpoint holds 1 entries under 'model' that the "
                                        r"state to load into lacks, e\.g\. \['model\.b'\]")


def test_unprimed_optimizer_state_dict_is_refused(tmp_path):
    model = torch.nn.Linear(4, 3).to(xshard.device())
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.ones(2, 4, device=xshard.device())).sum().backward()
        opt.step()
    xcp.save({"optim": opt.state_dict()}, tmp_path / "ckpt")
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).to(xshard.device()).parameters())
    with pytest.raises(CheckpointError, match=r"xshard\.checkpoint\.prime_optimizer\(opt\)"):
        xcp.load({"optim": fresh.state_dict()}, tmp_path / "ckpt")
    assert not fresh.state  # nothing loaded, nothing created
    xcp.load({"optim": fresh}, tmp_path / "ckpt")  # the optimizer itself is primed, then loaded
    assert_same(snapshot(fresh.state_dict()), snapshot(opt.state_dict()))


class Schedule:
    """An object DCP knows nothing about, inside a list of dicts (as in an optimizer's groups)."""


def test_a_failed_load_leaves_containers_and_unknown_objects_alone(checkpoint):
    schedule, groups = Schedule(), [{"schedule": None, "betas": (0.9, 0.99)}]
    groups[0]["schedule"] = schedule
    state = fresh_state(b=on_device(torch.zeros(9, 6)))
    state["groups"] = groups
    with pytest.raises(CheckpointError, match=r"Key 'groups\.0\.schedule' .* not in the "
                                              r"checkpoint.*'model\.b'"):
        xcp.load(state, checkpoint)
    assert state["groups"] is groups and groups[0]["schedule"] is schedule


def test_a_read_failing_half_way_changes_nothing(tmp_path):
    xcp.save({"model": {"a": on_device(SAVED["a"]), "b": on_device(SAVED["b"])}, "step": 4},
             tmp_path / "ckpt")
    data = tmp_path / "ckpt" / "__0_0.distcp"
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # damage the last item: earlier ones still read fine
        f.truncate(size - 64)
    before = snapshot(fresh_state())
    state = fresh_state()
    with pytest.raises(CheckpointError, match=r"Loading .*ckpt failed on process 0 "
                                              r"\(nothing was written into the state\): "
                                              r"RuntimeError: PytorchStreamReader failed"):
        xcp.load(state, tmp_path / "ckpt")
    assert_same(state, before)


def test_save_refuses_an_existing_path_unless_overwrite(tmp_path, checkpoint):
    path = tmp_path / "ckpt"
    xcp.save({"x": on_device(torch.ones(2))}, path)
    with pytest.raises(CheckpointError, match=r"ckpt already exists \(a checkpoint\)\. Save to a "
                                              r"new path .* or pass overwrite=True"):
        xcp.save({"x": on_device(torch.zeros(2))}, path)
    xcp.save({"x": on_device(torch.full((2,), 5.0))}, path, overwrite=True)
    state = {"x": on_device(torch.zeros(2))}
    xcp.load(state, path)
    assert torch.equal(state["x"].cpu(), torch.full((2,), 5.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial or .old left behind
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"file already exists \(a file, not a checkpoint "
                                              r"directory,\)"):
        xcp.save({"x": on_device(torch.ones(2))}, tmp_path / "file", overwrite=True)


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"A checkpoint's state must be a dict .* got list"):
        xcp.save([on_device(torch.ones(2))], tmp_path / "x")
    with pytest.raises(TypeError, match="overwrite must be a bool, got 1"):
        xcp.save({}, tmp_path / "x", overwrite=1)
    with pytest.raises(TypeError, match="defer_writes must be a bool"):
        xcp.LoadPlanner(defer_writes="yes")
    with pytest.raises(TypeError, match="prime_optimizer needs a torch.optim.Optimizer"):
        xcp.prime_optimizer(torch.nn.Linear(2, 2))


def test_several_processes_need_a_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"2 processes but no torch\.distributed process group"
                                           r".*Call xshard\.initialize\(\)"):
        xcp.save({"x": on_device(torch.ones(2))}, tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_with_the_planner_checks_before_reading(checkpoint):
    state = fresh_state(b=on_device(torch.zeros(9, 6)))
    before = snapshot(state)
    with pytest.raises(CheckpointException, match=r"Key 'model\.b': the checkpoint holds a tensor "
                                                  r"of shape \(9, 5\)"):
        dcp.load(state, checkpoint_id=str(checkpoint), planner=xcp.LoadPlanner())
    assert_same(state, before)


@pytest.mark.parametrize("when, left", [("after_data", ["__0_0.distcp"]),
                                        ("before_rename", [".metadata", "__0_0.distcp"])])
def test_interrupted_save_leaves_nothing_that_loads(tmp_path, when, left):
    path = tmp_path / "ckpt"
    result = run_script("interrupted_save.py", str(path), when, devices=2)
    assert result["returncode"] == 17, result["stderr"]
    assert not path.exists()
    assert sorted(os.listdir(tmp_path / "ckpt.partial")) == left
    state = {"w": on_device(torch.zeros(8, 8)), "step": 0}
    with pytest.raises(CheckpointNotFoundError,
                       match=r"No checkpoint at .*ckpt: the directory does not exist\. .*"
                             r"ckpt\.partial exists: a save to this path was interrupted"):
        xcp.load(state, path)
    if when == "after_data":
        with pytest.raises(CheckpointNotFoundError, match=r"has no \.metadata file"):
            xcp.load(state, tmp_path / "ckpt.partial")
    assert torch.equal(state["w"].cpu(), torch.zeros(8, 8)) and state["step"] == 0
    # The next save to the path clears the leftover and commits.
    xcp.save({"w": on_device(torch.arange(64.0).reshape(8, 8)), "step": 3}, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    xcp.load(state, path)
    assert torch.equal(state["w"].cpu(), torch.arange(64.0).reshape(8, 8)) and state["step"] == 3
