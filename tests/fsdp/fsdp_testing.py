"""Shared models and helpers for the FSDP tests (8 virtual CPU devices, see tests/conftest.py)."""

from __future__ import annotations

import copy
import functools
import re

import torch
import torch.nn as nn

import xshard
from xshard.fsdp import FSDP, size_based_auto_wrap_policy, transformer_auto_wrap_policy
from xshard.mesh import Mesh
from xshard.models import GPT, GPTConfig
from xshard.models.gpt import Block

VOCAB, SEQ, BATCH = 64, 16, 8
# No biases: the gradient of an attention key bias is zero up to rounding, and Adam turns that
# rounding noise into full-size updates, so such a parameter can't be compared after a few steps.
CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=32, dropout=0.0,
                bias=False)
SMALL = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                  bias=False)

POLICIES = {
    "transformer": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    # A block holds 12*32*32 + 2*32 = 12352 parameters (attention 4096, each MLP Linear 4096);
    # the embeddings 64*32 + 16*32 = 2560. At 4000 the attention and each MLP Linear are units.
    "size": functools.partial(size_based_auto_wrap_policy, min_num_params=4000),
}


def mesh(n: int, axes=("fsdp",), shape=None) -> Mesh:
    return Mesh(range(n), shape or (n,), axes)


def gpt(seed: int = 0, cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(n: int, seed: int = 1, distinct: int = 2):
    """``n`` batches cycling through ``distinct`` random ones (so the loss goes down)."""
    g = torch.Generator().manual_seed(seed)
    pool = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(distinct)]
    return [pool[i % distinct] for i in range(n)]


# Adam divides by sqrt(v) + eps: with PyTorch's eps=1e-8, a gradient that is zero up to float32
# summation-order noise (~1e-9, e.g. an exactly cancelling first-step entry) becomes a step of a
# sizeable fraction of lr whose sign is that noise. eps=1e-6 keeps such a step below 1e-5 while every
# real gradient here (~1e-3) still takes full-size Adam steps, so parameters compare tightly.
ADAM_EPS = 1e-6


def train_cpu(model: nn.Module, data, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_device(model: nn.Module, data, lr: float = 1e-2):
    """AdamW steps on the device; returns (losses, compile count after each step, optimizer)."""
    dev = xshard.device()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=ADAM_EPS)
    losses, compiles = [], []
    for x, y in data:
        loss = model(x.to(dev), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()
        losses.append(loss.item())
        compiles.append(xshard.metrics.snapshot()["compiles"])
    return losses, compiles, opt


def fsdp_copy(model: nn.Module, **kwargs) -> FSDP:
    return FSDP(copy.deepcopy(model), **kwargs)


def shard_bytes_per_device(tensors) -> dict[int, int]:
    """Bytes each device holds for ``tensors`` (device data, padding included), by device id."""
    out: dict[int, int] = {}
    seen = set()
    for t in tensors:
        array = t._cell.value.payload
        if id(array) in seen:
            continue
        seen.add(id(array))
        for shard in array.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def count_ops(hlo: str, name: str) -> int:
    return len(re.findall(rf"\b{re.escape(name)}(-start)?\(", hlo))
