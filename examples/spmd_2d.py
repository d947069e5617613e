"""Data x model (2-D) sharding of a GPT with Megatron-style specs, checked against eager CPU.

The 8 devices form a (4, 2) mesh ('data', 'model'). The batch is split over 'data'; inside each
block the attention qkv and MLP fc weights are split by output features over 'model'
(column-parallel) and the projections after them by input features (row-parallel), so each block
needs one all-reduce over 'model' per sub-layer; XLA's partitioner inserts it. The embedding (tied
to the LM head) is split over the vocabulary.

Run:  XSHARD_CPU_DEVICES=8 python examples/spmd_2d.py
"""

import copy
import re
import sys

import numpy as np
import torch

import xshard
import xshard.spmd as xs
from xshard.models.gpt import GPT, GPTConfig

STEPS = 5


def shard_megatron(model: GPT, mesh: xs.Mesh) -> None:
    xs.mark_sharding(model.wte.weight, mesh, ("model", None))  # vocab-parallel, tied to lm_head
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        xs.mark_sharding(attn.qkv.weight, mesh, ("model", None))  # column-parallel
        xs.mark_sharding(attn.qkv.bias, mesh, ("model",))
        xs.mark_sharding(attn.proj.weight, mesh, (None, "model"))  # row-parallel
        xs.mark_sharding(mlp.fc.weight, mesh, ("model", None))
        xs.mark_sharding(mlp.fc.bias, mesh, ("model",))
        xs.mark_sharding(mlp.proj.weight, mesh, (None, "model"))


def batches(cfg: GPTConfig, n: int, batch: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        yield data[:, :-1].contiguous(), data[:, 1:].contiguous()


def main() -> int:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    mesh = xs.Mesh(np.arange(8), (4, 2), ("data", "model"))

    reference = GPT(cfg)
    model = copy.deepcopy(reference).to(xshard.device())
    shard_megatron(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)

    # Batches arrive split over 'data', the next one transferred while this step runs.
    loader = xs.MpDeviceLoader(batches(cfg, STEPS, 8), xshard.device(),
                               input_sharding=xs.ShardingSpec(mesh, ("data", None)))
    worst = 0.0
    for step, ((idx, targets), (ref_idx, ref_targets)) in enumerate(
            zip(loader, batches(cfg, STEPS, 8))):
        loss = model(idx, targets)
        if step == 0:
            hlo = xshard.debug.compiled_hlo_text([loss])
            found = sorted(set(re.findall(r"\b(all-reduce|all-gather|reduce-scatter)\b", hlo)))
            print(f"collectives in the partitioned forward: {', '.join(found)}")
        loss.backward()
        opt.step()
        opt.zero_grad()
        xshard.sync()

        ref_loss = reference(ref_idx, ref_targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diff = abs(loss.item() - ref_loss.item())
        worst = max(worst, diff)
        print(f"step {step}: loss {loss.item():.5f}  (eager CPU {ref_loss.item():.5f})")

    block = model.blocks[0]
    for name, p in [("wte.weight", model.wte.weight), ("attn.qkv.weight", block.attn.qkv.weight),
                    ("attn.proj.weight", block.attn.proj.weight),
                    ("mlp.fc.bias", block.mlp.fc.bias), ("ln_1.weight", block.ln_1.weight)]:
        print(f"{name:17s} {xs.get_sharding_spec(p) or '(replicated)'}")
    print(f"AdamW exp_avg of qkv.weight: "
          f"{xs.get_sharding_spec(opt.state[block.attn.qkv.weight]['exp_avg'])}")
    print(f"compiles: {xshard.metrics.snapshot()['compiles']} (the first step creates the "
          f"optimizer state; later steps reuse one executable)")

    param_diff = max((p.cpu() - r.detach()).abs().max().item()
                     for p, r in zip(model.parameters(), reference.parameters()))
    print(f"max |loss - CPU loss| = {worst:.2e}, max |param - CPU param| = {param_diff:.2e}")
    if worst > 1e-3 or param_diff > 1e-3:
        print("MISMATCH against eager CPU PyTorch", file=sys.stderr)
        return 1
    print("OK: the 2-D sharded run matches eager CPU PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
