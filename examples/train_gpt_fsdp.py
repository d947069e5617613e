"""Train a GPT-style model under FSDP on every available device (8 virtual CPU devices by default).

Each step prints the loss; at the end the example shows how a few parameters are sharded and how much
memory each device holds: the live device buffers (parameters, gradients, optimizer state, all split
over the 'fsdp' axis) and XLA's compiled memory statistics of one training step (arguments, outputs,
temporaries). With ``--check`` it also trains the unwrapped model on eager CPU and compares losses.
With ``--accumulate K`` each step accumulates gradients over K micro-batches, all but the last under
``model.no_sync()`` (no gradient collective in those). With ``--profile LOGDIR`` the training steps
are traced (``xshard.profiler``): each step is a ``StepTrace`` span holding ``forward``,
``backward`` and ``optimizer`` spans; see the README's "Profiling" section.

Run:  python examples/train_gpt_fsdp.py --steps 10 --policy transformer
      python examples/train_gpt_fsdp.py --accumulate 4 --check
      python examples/train_gpt_fsdp.py --steps 4 --profile /tmp/gpt-profile
"""

import argparse
import contextlib
import copy
import functools
import os
import sys
import time

os.environ.setdefault("XSHARD_CPU_DEVICES", "8")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import xshard  # noqa: E402
import xshard.profiler as xp  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.core import compiler, execute  # noqa: E402
from xshard.fsdp import FSDP, size_based_auto_wrap_policy, transformer_auto_wrap_policy  # noqa: E402
from xshard.memory import format_bytes, live_bytes_per_device  # noqa: E402
from xshard.models.gpt import GPT, Block, GPTConfig  # noqa: E402

SIZES = {  # name: (n_layer, n_embd, n_head)
    "tiny": (4, 64, 4),
    "small": (6, 128, 4),
    "medium": (8, 256, 8),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    parser.add_argument("--policy", choices=["transformer", "size"], default="transformer",
                        help="auto-wrap policy: one unit per Block, or by parameter count")
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over devices)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="micro-batches per step, all but the last under model.no_sync()")
    parser.add_argument("--check", action="store_true",
                        help="also train the unwrapped model on eager CPU and compare the losses")
    parser.add_argument("--profile", metavar="LOGDIR",
                        help="trace the training steps into LOGDIR (xshard.profiler)")
    args = parser.parse_args(argv)
    if args.accumulate < 1 or args.batch % args.accumulate:
        parser.error(f"--accumulate {args.accumulate} must be a positive divisor of --batch "
                     f"{args.batch} (each micro-batch holds batch / K sequences).")
    return args


def train_step(model, opt, x, y, k: int, sync_each: bool):
    """One optimizer step over ``k`` micro-batches of (x, y); returns the mean loss (a tensor)."""
    total = 0.0
    micro = list(zip(x.chunk(k), y.chunk(k)))
    for i, (mx, my) in enumerate(micro):
        quiet = i < k - 1 and isinstance(model, FSDP)
        with model.no_sync() if quiet else contextlib.nullcontext():
            with xp.Trace("forward"):
                loss = model(mx, my) / k
            with xp.Trace("backward"):
                loss.backward()
        total = total + loss.detach()
        if sync_each and i < k - 1:
            xshard.sync()  # one graph per micro-batch: a micro-batch's activations are freed
    with xp.Trace("optimizer"):
        opt.step()
        opt.zero_grad()
    if sync_each:
        # The step's graph, named after the function that syncs it: jit(xshard_train_step_<n>).
        xshard.sync()
    return total


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console()
    n_layer, n_embd, n_head = SIZES[args.size]
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, dropout=0.0)
    torch.manual_seed(0)
    reference = GPT(cfg)
    if args.policy == "transformer":
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    else:
        per_block = 12 * n_embd * n_embd
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=per_block // 2)
    model = FSDP(copy.deepcopy(reference), auto_wrap_policy=policy)
    n_devices = model.mesh.size()
    console.print(f"[bold]GPT[/] {cfg.num_params() / 1e6:.2f} M parameters, "
                  f"{len(model.fsdp_units)} FSDP units ({args.policy} policy) on {n_devices} "
                  f"{xshard.runtime.platform()} devices, mesh {model.mesh.mesh_shape} "
                  f"{model.mesh.axis_names}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
            for _ in range(2)]
    dev = xshard.device()
    worst = 0.0
    if args.profile:
        xp.start_trace(args.profile)
    for step in range(args.steps):
        batch = data[step % len(data)]
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        start = time.perf_counter()
        with xp.StepTrace("train", step_num=step):  # a span per step; syncs at its end
            loss = train_step(model, opt, x.to(dev), y.to(dev), args.accumulate, sync_each=True)
        value = loss.item()
        line = f"step {step:3d}  loss {value:.4f}  {time.perf_counter() - start:6.2f} s"
        if args.check:
            ref_loss = train_step(reference, ref_opt, x, y, args.accumulate, sync_each=False)
            worst = max(worst, abs(value - ref_loss.item()))
            line += f"  (eager CPU {ref_loss.item():.4f})"
        console.print(line)
    if args.profile:
        console.print(f"trace written to {xp.stop_trace()}")
    snap = xshard.metrics.snapshot()
    console.print(f"compiles: {snap['compiles']} ({snap['compile_seconds']:.1f} s), "
                  f"cache hits: {snap['cache_hits']}")

    shardings = Table(title="Parameter shardings")
    shardings.add_column("parameter")
    shardings.add_column("shape")
    shardings.add_column("sharding (HLO)")
    for name in ["wte.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.proj.weight",
                 "blocks.0.ln_1.weight"]:
        p = model.get_parameter(name)
        shardings.add_row(name, str(tuple(p.shape)), xs.get_sharding_spec(p))
    console.print(shardings)

    # One more step, compiled but not run, for XLA's view of its memory per device.
    x, y = data[0][:, :-1].contiguous(), data[0][:, 1:].contiguous()
    model(x.to(dev), y.to(dev)).backward()
    opt.step()
    opt.zero_grad()
    stats = compiler.compile_graph(execute.pending_step().graph).memory_analysis()
    xshard.sync(wait=True)
    live = live_bytes_per_device()

    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + 2 moments
    memory = Table(title="Per-device memory")
    memory.add_column("device")
    memory.add_column("live buffers", justify="right")
    for device_id in sorted(live):
        memory.add_row(f"{xshard.runtime.platform()}:{device_id}", format_bytes(live[device_id]))
    console.print(memory)
    compiled = Table(title="Compiled training step, per device (XLA memory analysis)")
    for column in ["arguments", "outputs", "temporaries", "aliased (donated)"]:
        compiled.add_column(column, justify="right")
    compiled.add_row(format_bytes(stats.argument_size_in_bytes),
                     format_bytes(stats.output_size_in_bytes),
                     format_bytes(stats.temp_size_in_bytes), format_bytes(stats.alias_size_in_bytes))
    console.print(compiled)
    console.print(f"parameters + Adam state replicated: {format_bytes(state)}; "
                  f"1/{n_devices} of it: {format_bytes(state / n_devices)}")
    if args.check:
        ok = worst < 1e-3
        console.print(f"{'OK' if ok else 'MISMATCH'}: largest loss difference from eager CPU "
                      f"{worst:.2e}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
