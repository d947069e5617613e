"""Gradient accumulation under FSDP: ``no_sync()`` against reducing every micro-step.

Both sides train the same GPT-style model under FSDP (transformer policy) in this process, on the same
devices, from identical weights and on identical micro-batches; an optimizer step follows every
``--micro`` micro-steps, and every micro-step ends with ``xshard.sync()`` (as a memory-bound loop
would). The baseline reduces each micro-step's gradients (plain backward); the other side runs all but
the last micro-step of a round under ``model.no_sync()``.

Printed: the reductions (all-reduce / reduce-scatter) XLA compiled into each micro-step and the bytes
they move, the time per accumulation round and the ratio, and the largest parameter difference
after the timed rounds (the two must train the same model). Warm-up rounds (which compile) are not
timed; the sides alternate round by round.

Usage:
    python benchmarks/bench_accumulation.py                  # 8 virtual CPU devices
    python benchmarks/bench_accumulation.py --layers 8 --embd 512 --micro 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import re
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (on CPU)")
    p.add_argument("--micro", type=int, default=4, help="micro-steps per optimizer step")
    p.add_argument("--rounds", type=int, default=3, help="timed accumulation rounds per side")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--block", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("devices", "micro", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices} (the batch "
                f"is split over the devices).")
    return args


_REDUCTION = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (?:all-reduce|reduce-scatter)(?:-start)?\(")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "s64": 8}


def reductions(hlo: str) -> tuple[int, int]:
    """(count, bytes) of the all-reduces and reduce-scatters in compiled HLO."""
    count = size = 0
    for dtype, dims in _REDUCTION.findall(hlo):
        count += 1
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        size += n * _BYTES.get(dtype, 4)
    return count, size


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("XSHARD_CPU_DEVICES", str(args.devices))
    import torch
    from rich.console import Console
    from rich.table import Table

    import xshard
    from xshard.core import compiler, execute
    from xshard.fsdp import FSDP, transformer_auto_wrap_policy
    from xshard.models import GPT, GPTConfig
    from xshard.models.gpt import Block

    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.embd, dropout=0.0, bias=False)
    base = GPT(cfg)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    dev = xshard.device()
    g = torch.Generator().manual_seed(args.seed + 1)
    data = [(torch.randint(0, args.vocab, (args.batch, args.block), generator=g),
             torch.randint(0, args.vocab, (args.batch, args.block), generator=g))
            for _ in range(args.micro)]
    data = [(x.to(dev), y.to(dev)) for x, y in data]

    class Side:
        def __init__(self, name, use_no_sync):
            self.name, self.use_no_sync = name, use_no_sync
            self.model = FSDP(copy.deepcopy(base), auto_wrap_policy=policy)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            self.times, self.per_micro = [], None

        def round(self, inspect=False):
            start = time.perf_counter()
            seen = []
            for i, (x, y) in enumerate(data):
                quiet = self.use_no_sync and i < len(data) - 1
                with self.model.no_sync() if quiet else contextlib.nullcontext():
                    self.model(x, y).backward()
                if i == len(data) - 1:
                    self.opt.step()
                    self.opt.zero_grad()
                if inspect:
                    step = execute.pending_step()
                    seen.append(reductions(compiler.executable(step.graph).compiled.as_text()))
                xshard.sync()
            xshard.sync(wait=True)
            if inspect:
                self.per_micro = seen
            return time.perf_counter() - start

    sides = [Side("reduce every micro-step", False), Side("no_sync()", True)]
    for side in sides:
        side.round(inspect=True)  # compiles
        side.round()
    for _ in range(args.rounds):
        for side in sides:
            side.times.append(side.round())

    console = Console()
    params = sum(p.numel() for p in base.parameters())
    table = Table(title=f"GPT {params / 1e6:.1f} M params, FSDP on {args.devices} devices, "
                        f"{args.micro} micro-steps of batch {args.batch} per optimizer step")
    for col in ("side", "reductions per micro-step", "MiB reduced per round", "ms per round",
                "vs baseline"):
        table.add_column(col, justify="right" if col != "side" else "left")
    baseline = min(sides[0].times)
    for side in sides:
        best = min(side.times)
        counts = " ".join(str(c) for c, _ in side.per_micro)
        moved = sum(b for _, b in side.per_micro) / 2**20
        table.add_row(side.name, counts, f"{moved:.1f}", f"{best * 1e3:.1f}",
                      f"{best / baseline:.2f}x")
    console.print(table)
    diff = max((a.detach().cpu() - b.detach().cpu()).abs().max().item() for a, b in
               zip(sides[0].model.parameters(), sides[1].model.parameters()))
    console.print(f"largest parameter difference after {args.rounds + 2} optimizer steps: "
                  f"{diff:.2e}")


if __name__ == "__main__":
    main()
