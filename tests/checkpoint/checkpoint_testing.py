"""Shared helpers for the checkpoint tests (1 process x 8 virtual CPU devices, see tests/conftest.py;
1 x 1 through a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import xshard
import xshard.spmd as xs
from xshard.core import api
from xshard.models import GPT
from xshard.fsdp import FSDP

from tests.fsdp.fsdp_testing import ADAM_EPS, POLICIES, SMALL, batches, gpt  # noqa: F401

DEV = xshard.device()
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LR = 1e-2


def mesh(shape=(8,), names=("x",)) -> xs.Mesh:
    return xs.Mesh(np.arange(int(np.prod(shape))), shape, names)


def on_device(cpu: torch.Tensor, m: xs.Mesh | None = None, spec=None) -> torch.Tensor:
    t = cpu.to(DEV)
    if m is not None:
        xs.mark_sharding(t, m, spec)
    return t


def spec_of(t: torch.Tensor) -> str:
    return xs.get_sharding_spec(t)


def fsdp_gpt(seed: int, policy: str = "transformer", m: xs.Mesh | None = None) -> FSDP:
    return FSDP(gpt(seed=seed, cfg=SMALL), mesh=m, auto_wrap_policy=POLICIES[policy])


def shard_2d(model: GPT, m: xs.Mesh) -> GPT:
    """Megatron-style tensor parallelism over ``model``, the rest replicated over ``data``."""
    model.to(DEV)
    xs.mark_sharding(model.wte.weight, m, ("model", None))  # tied to lm_head
    for block in model.blocks:
        xs.mark_sharding(block.attn.qkv.weight, m, ("model", None))
        xs.mark_sharding(block.attn.proj.weight, m, (None, "model"))
        xs.mark_sharding(block.mlp.fc.weight, m, ("model", None))
        xs.mark_sharding(block.mlp.proj.weight, m, (None, "model"))
    return model


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)


def train(model: nn.Module, opt, data, batch_mesh: xs.Mesh | None = None) -> list[float]:
    """AdamW steps on the device; the batch split over ``data`` when ``batch_mesh`` is given."""
    losses = []
    for x, y in data:
        x, y = x.to(DEV), y.to(DEV)
        if batch_mesh is not None:
            xs.mark_sharding(x, batch_mesh, ("data", None))
            xs.mark_sharding(y, batch_mesh, ("data", None))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
        losses.append(loss.item())
    return losses


def snapshot(state):
    """Nested CPU copy of a state: device tensors read back, everything else copied."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    return state


def model_state(model: nn.Module) -> dict:
    """The module's tensors as they live (device tensors for FSDP too), read back to CPU."""
    return snapshot(dict(nn.Module.state_dict(model)))


def assert_same(got, expected, where: str = "state") -> None:
    """Bit-exact equality of nested states (tensors: same dtype, shape and bits)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for k in expected:
            assert_same(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}.{i}")
    elif isinstance(expected, torch.Tensor):
        got = got.detach().cpu()
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    else:
        assert got == expected and type(got) is type(expected), where


def shard_shapes(t: torch.Tensor) -> set:
    return {tuple(s.data.shape) for s in api.array(t).addressable_shards}


def run_script(name: str, *args: str, devices: int, timeout: int = 300) -> dict:
    """Runs tests/checkpoint/scripts/<name> in a fresh process with ``devices`` CPU devices; returns
    the JSON object of its last output line."""
    env = dict(os.environ, XSHARD_CPU_DEVICES=str(devices), PJRT_DEVICE="CPU",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    result["returncode"] = proc.returncode
    result["stderr"] = proc.stderr[-3000:]
    return result
