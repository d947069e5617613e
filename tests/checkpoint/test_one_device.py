"""1 x 8 <-> 1 x 1: a checkpoint written on 8 devices loads in a one-device process, and the
reverse (the one-device side runs in a subprocess with XSHARD_CPU_DEVICES=1)."""

import pytest
import torch

import xshard.checkpoint as xcp

from tests.checkpoint.checkpoint_testing import (adamw, assert_same, batches, fsdp_gpt, mesh,
                                                 model_state, on_device, run_script, shard_2d,
                                                 snapshot, spec_of, train, gpt, SMALL)


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory):
    """Saved here on 8 devices, loaded and re-saved by the one-device process."""
    root = tmp_path_factory.mktemp("one_device")
    model = fsdp_gpt(seed=3)
    opt = adamw(model)
    train(model, opt, batches(2))
    grid = on_device(torch.randn(6, 10), mesh((2, 4), ("a", "b")), ("a", "b"))
    state = {"model": model, "optim": opt, "step": 2, "extra": {"grid": grid}}
    xcp.save(state, root / "from_8")
    torch.save({"model": model_state(model), "optim": snapshot(opt.state_dict()),
                "extra": snapshot(state["extra"]), "step": 2}, root / "from_8.pt")
    result = run_script("one_device.py", str(root / "from_8"), str(root / "from_8.pt"),
                        str(root / "from_1"), str(root / "from_1.pt"), devices=1)
    return root, result


def test_8_device_checkpoint_loads_on_one_device(exchanged):
    _, result = exchanged
    assert result["returncode"] == 0, result["stderr"]
    assert result["devices"] == 1 and result["loaded_equal"]
    assert result["spec"] == "{replicated}"


def test_one_device_checkpoint_loads_on_8_devices(exchanged):
    root, result = exchanged
    assert result["returncode"] == 0, result["stderr"]
    expected = torch.load(root / "from_1.pt", weights_only=False)
    model = fsdp_gpt(seed=9)
    opt = adamw(model)
    state = {"model": model, "optim": opt, "step": 0,
             "extra": {"grid": on_device(torch.zeros(6, 10), mesh((4, 2), ("a", "b")), ("b", "a"))}}
    xcp.load(state, root / "from_1")
    assert state["step"] == 3
    assert_same(model_state(model), expected["model"])
    assert_same(snapshot(opt.state_dict()), expected["optim"])
    assert_same(snapshot(state["extra"]), expected["extra"])
    assert spec_of(model.blocks[0].mlp.fc.weight) == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    # and into a 2-D tensor-parallel model
    plain = shard_2d(gpt(seed=10, cfg=SMALL), mesh((4, 2), ("data", "model")))
    xcp.load({"model": plain}, root / "from_1")
    assert_same(model_state(plain), expected["model"])
