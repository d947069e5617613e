"""Checkpoint save and load time, and the bytes each process writes, for an FSDP GPT with AdamW.

The model (transformer wrap policy, all devices on the ``fsdp`` axis) takes one AdamW step so its
optimizer holds state; then ``xshard.checkpoint.save`` writes model, optimizer and step, and
``xshard.checkpoint.load`` reads them back into the same layout (the optimizer already primed, so
nothing compiles) and, resharded, into a 2-D (data, model) tensor-parallel copy of the model. Each
is timed over ``--rounds`` rounds (best and median); every save goes to a fresh directory, written
with fsync.

Usage:
    python benchmarks/bench_checkpoint.py                       # 1 process x 8 virtual CPU devices
    python benchmarks/bench_checkpoint.py --layers 2 --embd 32 --heads 4 --vocab 64 --block 16
    python -m xshard.launch --nproc 2 --cpu-devices 4 benchmarks/bench_checkpoint.py --dir /shared/x

Under the launcher every process prints its own line; ``--dir`` must be the same directory for all.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import shutil
import statistics
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (one process)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads for the run (0: PyTorch's default). DCP copies each "
                        "chunk with Tensor.copy_, which PyTorch parallelises over its threads; on "
                        "an oversubscribed host that copy can be 100x slower than with 1 thread")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "xshard_bench_checkpoint"),
                   help="where the checkpoints go (removed at the end)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.devices < 1:
        p.error("--rounds and --devices must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = "XSHARD_PROCESS_ID" in os.environ
    if not launched:
        os.environ.setdefault("XSHARD_CPU_DEVICES", str(args.devices))
        os.environ.setdefault("PJRT_DEVICE", "CPU")

    import numpy as np
    import torch

    import xshard
    import xshard.checkpoint as xcp
    import xshard.spmd as xs
    from xshard.fsdp import FSDP, transformer_auto_wrap_policy
    from xshard.models import GPT, GPTConfig
    from xshard.models.gpt import Block

    if launched:
        xshard.initialize()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    rank, world, n = xshard.process_index(), xshard.process_count(), xshard.device_count()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.embd, dropout=0.0)
    dev = xshard.device()

    torch.manual_seed(0)
    model = FSDP(GPT(cfg), mesh=xs.Mesh(np.arange(n), (n,), ("fsdp",)),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size))
    model(x.to(dev), x.to(dev)).backward()
    opt.step()
    opt.zero_grad()
    xshard.sync(wait=True)
    state = {"model": model, "optim": opt, "step": 1}
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    state_bytes += sum(t.numel() * t.element_size() for s in opt.state.values()
                       for t in s.values() if isinstance(t, torch.Tensor))

    saves, stagings, async_saves, loads, reshards, mine, total = [], [], [], [], [], 0, 0
    grid = xs.Mesh(np.arange(n), (max(n // 2, 1), 2 if n > 1 else 1), ("data", "model"))
    tensor_parallel = GPT(cfg).to(dev)
    xs.mark_sharding(tensor_parallel.wte.weight, grid, ("model", None))  # tied to lm_head
    for block in tensor_parallel.blocks:
        xs.mark_sharding(block.attn.qkv.weight, grid, ("model", None))
        xs.mark_sharding(block.attn.proj.weight, grid, (None, "model"))
        xs.mark_sharding(block.mlp.fc.weight, grid, ("model", None))
        xs.mark_sharding(block.mlp.proj.weight, grid, (None, "model"))
    for i in range(args.rounds):
        path = os.path.join(args.dir, f"round_{i}")
        begin = time.perf_counter()
        xcp.save(state, path, overwrite=True)
        saves.append(time.perf_counter() - begin)
        mine = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, f"__{rank}_*")))
        total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*")))
        total += os.path.getsize(os.path.join(path, ".metadata"))
        begin = time.perf_counter()
        pending = xcp.async_save(state, path + "_async", overwrite=True)
        stagings.append(time.perf_counter() - begin)  # when training may go on
        pending.result()
        async_saves.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        xcp.load(state, path)
        xshard.wait()
        loads.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        xcp.load({"model": tensor_parallel}, path)
        xshard.wait()
        reshards.append(time.perf_counter() - begin)

    def fmt(times):
        return f"{min(times):.3f} s best, {statistics.median(times):.3f} s median"

    print(f"process {rank}/{world} ({n} devices in all), GPT {cfg.n_layer}L d{cfg.n_embd} "
          f"V{cfg.vocab_size} T{cfg.block_size}: model + AdamW state {state_bytes / 2**20:.1f} MiB, "
          f"{torch.get_num_threads()} torch threads")
    print(f"  save:                     {fmt(saves)}; this process wrote "
          f"{mine / 2**20:.1f} MiB of {total / 2**20:.1f} MiB")
    print(f"  async_save, until it returns: {fmt(stagings)}; until written: {fmt(async_saves)}")
    print(f"  load, same layout:        {fmt(loads)}")
    print(f"  load into 2-D (data, model) model only: {fmt(reshards)}")
    print(json.dumps({"rank": rank, "world": world, "devices": n, "state_bytes": state_bytes,
                      "torch_threads": torch.get_num_threads(),
                      "bytes_written": mine, "bytes_total": total, "save_s": saves,
                      "async_save_return_s": stagings, "async_save_s": async_saves,
                      "load_s": loads, "load_2d_s": reshards}))
    if world > 1:  # everyone done with the files before process 0 removes them
        import torch.distributed as dist

        dist.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
