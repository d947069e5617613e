"""Checkpoints across process counts: run under the launcher, one JSON line per process.

    python -m xshard.launch --nproc 2 --cpu-devices 4 tests/multihost/scripts/checkpoint_roundtrip.py MODES DIR

MODES: one mode, or several joined by commas, run in that order by the same processes (a launch
costs seconds): the JSON line holds one entry per mode.
  save    an FSDP GPT over all devices, AdamW after 2 steps, a 2-D sharded tensor and the step,
          saved to DIR/ckpt (the same state tests/checkpoint/test_one_device.py saves on 1 x 8);
          process 0 writes the values to DIR/ckpt.pt; then 2 more steps (the uninterrupted run).
          Reports save time, bytes written by this process and the continued losses.
  load    loads DIR/ckpt into a 2-D (data, model) tensor-parallel GPT on a (4, 2) mesh, a primed
          AdamW and the tensor in another sharding; compares with DIR/ckpt.pt bit-exactly.
  resume  loads DIR/ckpt into the FSDP layout it was saved from and trains 2 steps; the losses
          must equal the save run's continued losses.
  async   as save, to DIR/async_ckpt with xcp.async_save, training 2 more steps while it writes;
          then loads it into a fresh FSDP model (compared bit-exactly with the values at the
          call) and trains those 2 steps again (the losses must equal the first 2).
Needs PYTHONPATH to hold the repository root (the tests' helpers are imported).
"""

import glob
import os
import sys
import time

import torch

from common import report, start

import xshard  # noqa: E402
import xshard.checkpoint as xcp  # noqa: E402

from tests.checkpoint.checkpoint_testing import (SMALL, adamw, assert_same, batches,  # noqa: E402
                                                 fsdp_gpt, gpt, mesh, model_state, on_device,
                                                 shard_2d, snapshot, train)


def values(state) -> dict:
    """Full CPU values (gathering reads: every process calls this, in the same order)."""
    return {"model": model_state(state["model"]), "optim": snapshot(state["optim"].state_dict()),
            "extra": snapshot(state["extra"]), "step": state["step"]}


def main() -> int:
    rank, world = start()
    modes, directory = sys.argv[1].split(","), sys.argv[2]
    report(rank=rank, world=world, devices=xshard.device_count(),
           **{mode: run(mode, rank, directory) for mode in modes})
    return 0


def run(mode: str, rank: int, directory: str) -> dict:
    path = os.path.join(directory, "ckpt")
    data = batches(4)
    n = xshard.device_count()
    out = {}
    if mode == "save":
        model = fsdp_gpt(seed=3, m=mesh((n,), ("fsdp",)))
        opt = adamw(model)
        train(model, opt, data[:2])
        grid = on_device(torch.arange(60.0).reshape(6, 10) / 7, mesh((2, n // 2), ("a", "b")),
                         ("a", "b"))
        state = {"model": model, "optim": opt, "step": 2, "extra": {"grid": grid}}
        xshard.sync(wait=True)
        begin = time.perf_counter()
        xcp.save(state, path)
        out["save_s"] = time.perf_counter() - begin
        out["bytes"] = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{rank}_*")))
        expected = values(state)
        if rank == 0:
            torch.save(expected, path + ".pt")
        out["continued"] = train(model, opt, data[2:])
    elif mode == "load":
        grid = mesh((n // 2, 2), ("data", "model"))
        model = shard_2d(gpt(seed=9, cfg=SMALL), grid)
        state = {"model": model, "optim": adamw(model), "step": 0,
                 "extra": {"grid": on_device(torch.zeros(6, 10), grid, ("model", "data"))}}
        begin = time.perf_counter()
        xcp.load(state, path)
        out["load_s"] = time.perf_counter() - begin
        assert_same(values(state), torch.load(path + ".pt", weights_only=False))
        out["equal"] = True
    elif mode == "resume":
        model = fsdp_gpt(seed=9, m=mesh((n,), ("fsdp",)))
        opt = adamw(model)
        state = {"model": model, "optim": opt, "step": 0,
                 "extra": {"grid": on_device(torch.zeros(6, 10))}}
        xcp.load(state, path)
        out["step"] = state["step"]
        out["losses"] = train(model, opt, data[2:])
    elif mode == "async":
        model = fsdp_gpt(seed=3, m=mesh((n,), ("fsdp",)))
        opt = adamw(model)
        train(model, opt, data[:2])
        state = {"model": model, "optim": opt, "step": 2, "extra": {"grid": on_device(
            torch.arange(60.0).reshape(6, 10) / 7, mesh((2, n // 2), ("a", "b")), ("a", "b"))}}
        expected = values(state)
        pending = xcp.async_save(state, os.path.join(directory, "async_ckpt"))
        out["continued"] = train(model, opt, data[2:])  # while the checkpoint is written
        pending.result()
        model = fsdp_gpt(seed=9, m=mesh((n,), ("fsdp",)))
        opt = adamw(model)
        state = {"model": model, "optim": opt, "step": 0,
                 "extra": {"grid": on_device(torch.zeros(6, 10))}}
        xcp.load(state, os.path.join(directory, "async_ckpt"))
        assert_same(values(state), expected)
        out["equal"] = True
        out["losses"] = train(model, opt, data[2:])
    else:
        raise SystemExit(f"unknown MODE {mode!r}; choose save, load, resume or async")
    return out


if __name__ == "__main__":
    sys.exit(main())
