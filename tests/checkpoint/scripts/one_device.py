"""The 1 x 1 side of the checkpoint round trips (run with XSHARD_CPU_DEVICES=1).

Usage: one_device.py SAVED EXPECTED OUT_CKPT OUT_EXPECTED
  Loads checkpoint SAVED (written on 8 devices) into an FSDP GPT, AdamW and a sharded tensor on this
  process's one device and compares them bit-exactly with EXPECTED (a torch.save of the values).
  Then takes one training step, saves checkpoint OUT_CKPT and writes the values to OUT_EXPECTED for
  the 8-device side to check. Prints one JSON line.
"""

import json
import sys

import torch

import xshard
import xshard.checkpoint as xcp

from tests.checkpoint.checkpoint_testing import (adamw, assert_same, batches, fsdp_gpt, mesh,
                                                 model_state, on_device, snapshot, spec_of, train)


def main() -> int:
    saved, expected_path, out_ckpt, out_expected = sys.argv[1:5]
    one = mesh((1,), ("fsdp",))
    model = fsdp_gpt(seed=21, m=one)
    opt = adamw(model)
    state = {"model": model, "optim": opt, "step": 0,
             "extra": {"grid": on_device(torch.zeros(6, 10), mesh((1,), ("x",)), ("x", None))}}
    xcp.load(state, saved)
    expected = torch.load(expected_path, weights_only=False)
    assert_same(model_state(model), expected["model"])
    assert_same(snapshot(opt.state_dict()), expected["optim"])
    assert_same(snapshot(state["extra"]), expected["extra"])
    assert state["step"] == expected["step"]

    losses = train(model, opt, batches(1, seed=5))
    state["step"] += 1
    xcp.save(state, out_ckpt)
    torch.save({"model": model_state(model), "optim": snapshot(opt.state_dict()),
                "extra": snapshot(state["extra"]), "step": state["step"]}, out_expected)
    print(json.dumps({"devices": xshard.device_count(), "loaded_equal": True,
                      "spec": spec_of(model.blocks[0].mlp.fc.weight), "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
