"""A tiny GPT trained under FSDP (lazily and compiled) and under a (data, model) mesh, with
per-process minibatches.

Run as 2 processes x 4 devices (through the launcher) and as 1 process x 8 devices (the oracle,
``main`` called by the test), the same script must give the same losses and parameters. Each
process loads its own part of every batch: a DistributedSampler and
``ShardingSpec(..., minibatch=True)``, with MpDeviceLoader prefetching two batches.

Process 0 saves ``{variant: {"losses": [...], "params": {...}}}`` to the path in argv[1].
"""

import functools
import sys

import numpy as np
import torch
import torch.nn.functional  # noqa: F401
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import report, start

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.fsdp import FSDP, transformer_auto_wrap_policy  # noqa: E402
from xshard.models.gpt import GPT, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
GLOBAL_BATCH = 16
STEPS = 3
VARIANTS = ("fsdp", "2d", "fsdp-compiled")


def data(rank: int, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH * STEPS, CFG.block_size + 1),
                           generator=g)
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def tensor_parallel(model: GPT, mesh) -> None:
    """Megatron-style: column-parallel qkv / fc, row-parallel proj, over the 'model' axis."""
    for block in model.blocks:
        for column in (block.attn.qkv, block.mlp.fc):
            xs.mark_sharding(column.weight, mesh, ("model", None))
            xs.mark_sharding(column.bias, mesh, ("model",))
        for row in (block.attn.proj, block.mlp.proj):
            xs.mark_sharding(row.weight, mesh, (None, "model"))


def train(variant: str, rank: int, world: int) -> dict:
    dev = xshard.device()
    torch.manual_seed(0)
    model = GPT(CFG)
    if variant in ("fsdp", "fsdp-compiled"):
        mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
        model = FSDP(model, mesh=mesh, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
        spec = xs.ShardingSpec(mesh, ("fsdp", None), minibatch=True)
    else:
        mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))
        model = model.to(dev)
        tensor_parallel(model, mesh)
        spec = xs.ShardingSpec(mesh, ("data", None), minibatch=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = xs.MpDeviceLoader(data(rank, world), dev, input_sharding=spec, prefetch=2)
    losses = []

    def train_step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step = xshard.compile(train_step) if variant == "fsdp-compiled" else train_step
    for x, y in loader:
        loss = step(x, y)
        xshard.sync()
        losses.append(loss.item())
    if variant == "fsdp-compiled":  # replayed with its parameters packed (see xshard/step)
        assert step.traces == 1 and step._last.packed, (step.retrace_reasons, step._last.packed)
    if variant != "2d":
        params = model.state_dict()  # gathered on every process
    else:
        params = {k: v.cpu() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "spec": xs.get_sharding_spec(x)}


def main(path=None):
    rank, world = start()
    out = {variant: train(variant, rank, world) for variant in VARIANTS}
    if path is not None and xshard.is_main_process():
        torch.save(out, path)
    report(rank=rank, losses={k: v["losses"] for k, v in out.items()},
           specs={k: v["spec"] for k, v in out.items()})
    return out


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
