"""Steady-state training step time: xshard against the same model written in pure JAX.

Both sides run in this process, on the same devices, from identical weights and on identical batches:

- xshard: the PyTorch model moved to ``xshard.device()``, ``torch.optim.AdamW``, ``loss.backward()``,
  ``opt.step()``, ``opt.zero_grad()``, ``xshard.sync()`` (one compiled graph per step, dispatched
  asynchronously);
- JAX: ``benchmarks/jax_models.py``, one ``jax.jit`` step (value_and_grad + hand-written AdamW) with
  donated parameters and optimizer state.

Warm-up steps (which compile) are not timed. The timed region is ``--rounds`` alternating rounds of
``--steps`` steps per side, each ending by blocking on the results, so neither side is favoured by the
machine warming up or by the other's background work. The losses of both runs are compared step by
step, so the two programs are shown to compute the same thing. The target (DESIGN.md) is an xshard
GPT step within 1.3x of JAX's.

Usage:
    python benchmarks/bench_step.py                      # MLP and GPT (~30 M parameters), 1 device
    python benchmarks/bench_step.py --model gpt --steps 5 --gpt-layers 4
    python benchmarks/bench_step.py --devices 8 --shard-batch   # data parallel, needs xshard.spmd
    python benchmarks/bench_step.py --devices 8 --fsdp          # FSDP against JAX, same shardings

``--fsdp``: xshard wraps the model in ``xshard.fsdp.FSDP`` (GPT: one unit per block; MLP: one per
Linear); JAX gets the same layout: every parameter and optimizer moment sharded over an ``fsdp`` axis
on its largest dimension, the batch split over it, and XLA's partitioner left to place the gathers
(the hand-written JAX FSDP program). Both sides' per-device temporary memory, from XLA's memory
analysis of the compiled step, is printed beside the times.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass, field


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("mlp", "gpt", "all"), default="all")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    p.add_argument("--rounds", type=int, default=2, help="alternating timed rounds per side")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (AdamW's first step compiles a different graph)")
    p.add_argument("--devices", type=int, default=1,
                   help="virtual CPU devices (sets XSHARD_CPU_DEVICES); unsharded data is replicated")
    p.add_argument("--shard-batch", action="store_true",
                   help="shard the batch over all devices (data parallel; needs xshard.spmd)")
    p.add_argument("--fsdp", action="store_true",
                   help="xshard: FSDP; JAX: parameters, optimizer state and batch sharded alike")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("MLP size")
    g.add_argument("--mlp-in", type=int, default=1024)
    g.add_argument("--mlp-hidden", type=int, default=2048)
    g.add_argument("--mlp-layers", type=int, default=4, help="Linear layers (ReLU between)")
    g.add_argument("--mlp-classes", type=int, default=1000)
    g.add_argument("--mlp-batch", type=int, default=256)
    g = p.add_argument_group("GPT size (defaults: 29.5 M parameters)")
    g.add_argument("--gpt-layers", type=int, default=8)
    g.add_argument("--gpt-embd", type=int, default=512)
    g.add_argument("--gpt-heads", type=int, default=8)
    g.add_argument("--gpt-vocab", type=int, default=8192)
    g.add_argument("--gpt-block", type=int, default=128, help="sequence length")
    g.add_argument("--gpt-batch", type=int, default=8)
    args = p.parse_args(argv)
    for name in ("steps", "rounds", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 2:
        p.error(f"--warmup must be at least 2 (step 1 and step 2 compile different graphs), "
                f"got {args.warmup}")
    if args.shard_batch and args.devices < 2:
        p.error("--shard-batch needs --devices 2 or more")
    if args.fsdp and args.shard_batch:
        p.error("--fsdp shards the batch itself; pass --fsdp or --shard-batch, not both")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Read by xshard once, before JAX initialises its backends: set it before importing xshard.
    os.environ["XSHARD_CPU_DEVICES"] = str(ARGS.devices)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import xshard  # noqa: E402
from xshard.fsdp import lambda_auto_wrap_policy, transformer_auto_wrap_policy  # noqa: E402
from xshard.models.gpt import GPT, Block, GPTConfig  # noqa: E402

jax = xshard.runtime.jax_module()  # configured by xshard (x64 on, device count) before first use
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_models as jm  # noqa: E402


# -- the models ------------------------------------------------------------------------------------


class BenchMLP(nn.Module):
    """Linear layers with ReLU between them and a cross-entropy loss (``net.0``, ``net.2``, ...)."""

    def __init__(self, d_in: int, hidden: int, n_linear: int, classes: int):
        super().__init__()
        dims = [d_in] + [hidden] * (n_linear - 1) + [classes]
        layers = []
        for i in range(n_linear):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < n_linear - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


@dataclass
class Case:
    """One benchmarked model: how to build it, its JAX loss (a function of the activations'
    sharding, see ``jax_models``), its batches (CPU tensors) and the auto-wrap policy that makes its
    FSDP units."""

    name: str
    build: callable
    jax_loss: callable
    batches: list = field(default_factory=list)
    fsdp_policy: callable = None


def make_cases(args) -> list[Case]:
    n_batches = args.warmup + args.steps * args.rounds
    gen = torch.Generator().manual_seed(args.seed + 1)
    cases = []
    if args.model in ("mlp", "all"):
        b, d, c = args.mlp_batch, args.mlp_in, args.mlp_classes
        batches = [(torch.randn(b, d, generator=gen), torch.randint(0, c, (b,), generator=gen))
                   for _ in range(n_batches)]
        cases.append(Case(
            f"MLP {args.mlp_layers}x{args.mlp_hidden}, batch {b}",
            lambda: BenchMLP(d, args.mlp_hidden, args.mlp_layers, c),
            functools.partial(jm.mlp_loss_fn, args.mlp_layers), batches,
            functools.partial(lambda_auto_wrap_policy,
                              lambda_fn=lambda m: isinstance(m, nn.Linear))))
    if args.model in ("gpt", "all"):
        cfg = GPTConfig(vocab_size=args.gpt_vocab, block_size=args.gpt_block,
                        n_layer=args.gpt_layers, n_head=args.gpt_heads, n_embd=args.gpt_embd)
        b, t, v = args.gpt_batch, args.gpt_block, args.gpt_vocab
        batches = [(torch.randint(0, v, (b, t), generator=gen),
                    torch.randint(0, v, (b, t), generator=gen)) for _ in range(n_batches)]
        cases.append(Case(
            f"GPT {cfg.n_layer}L d{cfg.n_embd} h{cfg.n_head} V{v} T{t}, batch {b}",
            lambda: GPT(cfg), functools.partial(jm.gpt_loss_fn, cfg), batches,
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})))
    return cases


# -- placement -------------------------------------------------------------------------------------


def jax_shardings(args):
    """(parameter sharding, batch sharding) for the JAX side, matching what xshard does.

    The parameter sharding is a ``jax.sharding.Sharding``, or under ``--fsdp`` a function of a
    parameter's shape giving its sharding: over ``fsdp`` on its largest dimension, as xshard's FSDP
    shards it (``xshard.fsdp.param_annotation``).
    """
    devices = xshard.runtime.devices()
    if len(devices) == 1:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        return one, one
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp" if args.fsdp else "data",))
    batch = jax.sharding.NamedSharding(mesh, P(mesh.axis_names[0]))
    replicated = jax.sharding.NamedSharding(mesh, P())
    if not args.fsdp:
        return replicated, batch if args.shard_batch else replicated

    def fsdp_sharding(shape):
        if not shape:
            return replicated
        dim = max(range(len(shape)), key=lambda d: (shape[d], -d))
        if shape[dim] % len(devices):
            raise SystemExit(f"--fsdp: a parameter of shape {tuple(shape)} does not split evenly "
                             f"over {len(devices)} devices on dimension {dim}, which jax.Array "
                             f"refuses; pick model sizes divisible by the device count.")
        return jax.sharding.NamedSharding(mesh, P(*[("fsdp" if d == dim else None)
                                                    for d in range(len(shape))]))

    return fsdp_sharding, batch


def placed(array: np.ndarray, sharding):
    """``array`` on the device(s), ``sharding`` being a Sharding or a function of the shape."""
    return jax.device_put(array, sharding(array.shape) if callable(sharding) else sharding)


def xshard_batch_marker(args, mesh=None):
    """A function that shards a device batch tensor on dim 0 over ``mesh``'s first axis (default a
    1-D ``data`` mesh), or None (replicated)."""
    if not (args.shard_batch or args.fsdp):
        return None
    import xshard.spmd as xs
    from xshard.mesh import get_1d_mesh

    mesh = mesh or get_1d_mesh("data")
    axis = mesh.axis_names[0]
    return lambda t: xs.mark_sharding(t, mesh, (axis,) + (None,) * (t.dim() - 1))


# -- the two runners -------------------------------------------------------------------------------


@dataclass
class Timing:
    step_ms: list = field(default_factory=list)   # per round: wall ms per step
    cpu_ms: list = field(default_factory=list)    # per round: this process's CPU ms per step
    trace_ms: list = field(default_factory=list)  # xshard only: host ms recording one step
    sync_ms: list = field(default_factory=list)   # xshard only: host ms in sync() per step
    losses: list = field(default_factory=list)
    temp_bytes: int = 0                           # per device, XLA's analysis of the steady step


class XShardRunner:
    def __init__(self, case: Case, args):
        torch.manual_seed(args.seed)
        self.model = case.build()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.initial = jm.params_from_torch(self.model)
        dev = xshard.device()
        if args.fsdp:
            from xshard.fsdp import FSDP

            self.model = FSDP(self.model, auto_wrap_policy=case.fsdp_policy)
            mark = xshard_batch_marker(args, self.model.mesh)
        else:
            self.model.to(dev)
            mark = xshard_batch_marker(args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.batches = []
        for x, y in case.batches:
            xd, yd = x.to(dev), y.to(dev)
            if mark is not None:
                mark(xd)
                mark(yd)
            self.batches.append((xd, yd))
        xshard.sync(wait=True)
        self.next = 0
        self.timing = Timing()
        self.recompiles = 0
        self._loss_tensors = []

    def step(self, analyze=False):
        x, y = self.batches[self.next]
        self.next += 1
        start = time.perf_counter()
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        traced = time.perf_counter()
        if analyze:  # the steady-state step's executable (the sync below reuses it)
            self.timing.temp_bytes = xshard.memory.analyze_step().temp_bytes
        xshard.sync()
        synced = time.perf_counter()
        self._loss_tensors.append(loss.detach())
        return traced - start, synced - traced

    def warmup(self, n):
        for _ in range(n - 1):
            self.step()
        self.step(analyze=True)
        xshard.wait()

    def timed(self, n):
        before = xshard.metrics.snapshot()
        cpu_start = time.process_time()
        start = time.perf_counter()
        trace = sync = 0.0
        for _ in range(n):
            t, s = self.step()
            trace += t
            sync += s
        xshard.wait()
        elapsed = time.perf_counter() - start
        self.timing.cpu_ms.append((time.process_time() - cpu_start) / n * 1e3)
        after = xshard.metrics.snapshot()
        self.recompiles += after["compiles"] - before["compiles"]
        self.fallbacks = after["cpu_fallbacks"]
        self.timing.step_ms.append(elapsed / n * 1e3)
        self.timing.trace_ms.append(trace / n * 1e3)
        self.timing.sync_ms.append(sync / n * 1e3)

    def losses(self):
        return [float(t.item()) for t in self._loss_tensors]


class JaxRunner(jm.TrainLoop):
    def __init__(self, case: Case, initial: dict, args, constrain_activations=False):
        param_sharding, batch_sharding = jax_shardings(args)
        # A copy: the step donates its inputs, and xshard's runner keeps ``initial`` for reference.
        params = jax.tree.map(lambda a: placed(np.asarray(a), param_sharding), initial)
        state = jax.tree.map(lambda a: placed(np.zeros(a.shape, np.float32), param_sharding),
                             jm.adamw_init(params))
        batches = [(jax.device_put(x.numpy(), batch_sharding),
                    jax.device_put(y.numpy(), batch_sharding)) for x, y in case.batches]
        shard = (batch_sharding, batch_sharding) if args.shard_batch or args.fsdp else None
        loss = case.jax_loss(activation_sharding=batch_sharding if constrain_activations else None)
        super().__init__(params, state, batches, loss, jm.AdamW(lr=args.lr), shard)
        self.timing = Timing()

    def warmup(self, n):
        for _ in range(n):
            self.step()
        self.block()
        x, y = self.batches[0]  # the executable the steps ran (JAX caches it)
        compiled = self.fn.jitted.lower(self.params, self.state, x, y,
                                        *jm.host_scalars(self.opt, 1)).compile()
        self.timing.temp_bytes = compiled.memory_analysis().temp_size_in_bytes

    def timed(self, n):
        cpu_start = time.process_time()
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        self.block()
        self.timing.step_ms.append((time.perf_counter() - start) / n * 1e3)
        self.timing.cpu_ms.append((time.process_time() - cpu_start) / n * 1e3)


# -- main ------------------------------------------------------------------------------------------


def jax_baselines(args) -> list[tuple[str, bool]]:
    """(label, constrain activations) of each JAX program xshard is measured against.

    Under ``--fsdp`` two: JAX's FSDP idiom (activations pinned to the batch sharding, so the
    partitioner gathers weights where each layer runs, as FSDP does) and the same shardings with the
    activations left free (the partitioner may then move activations instead of weights: another
    algorithm, not FSDP, and sometimes the faster one).
    """
    if args.fsdp:
        return [("JAX FSDP", True), ("JAX, free layout", False)]
    return [("JAX", False)]


def run_case(case: Case, args) -> list[dict]:
    """One result per JAX baseline, all runners timed in alternating rounds."""
    xs = XShardRunner(case, args)
    baselines = [(label, JaxRunner(case, xs.initial, args, constrain))
                 for label, constrain in jax_baselines(args)]
    del xs.initial
    start = time.perf_counter()
    xs.warmup(args.warmup)
    warmup_s = {"xshard": time.perf_counter() - start}
    for label, jx in baselines:
        start = time.perf_counter()
        jx.warmup(args.warmup)
        warmup_s[label] = time.perf_counter() - start
    for _ in range(args.rounds):
        for _, jx in baselines:
            jx.timed(args.steps)
        xs.timed(args.steps)
    x_losses = xs.losses()
    best = xs.timing.step_ms.index(min(xs.timing.step_ms))
    results = []
    for label, jx in baselines:
        j_losses = jx.losses()
        results.append({
            "name": case.name,
            "baseline": label,
            "params": xs.params,
            "xshard_ms": min(xs.timing.step_ms),
            "jax_ms": min(jx.timing.step_ms),
            "xshard_cpu_ms": min(xs.timing.cpu_ms),
            "jax_cpu_ms": min(jx.timing.cpu_ms),
            "xshard_ms_all": xs.timing.step_ms,
            "jax_ms_all": jx.timing.step_ms,
            # Host costs of the fastest xshard round (the one its step time is reported from).
            "trace_ms": xs.timing.trace_ms[best],
            "sync_ms": xs.timing.sync_ms[best],
            "warmup_s": (warmup_s["xshard"], warmup_s[label]),
            "recompiles": xs.recompiles,
            "fallbacks": xs.fallbacks,
            "max_loss_diff": max(abs(a - b) for a, b in zip(x_losses, j_losses)),
            "temp_bytes": (xs.timing.temp_bytes, jx.timing.temp_bytes),
            "loss_first_last": (x_losses[0], x_losses[-1], j_losses[0], j_losses[-1]),
        })
    return results


def print_results(results, args):
    from rich.console import Console
    from rich.table import Table

    mode = ("FSDP" if args.fsdp else "batch sharded" if args.shard_batch
            else "replicated" if args.devices > 1 else "")
    title = (f"Training step, xshard vs pure JAX, {args.devices} {xshard.runtime.platform()} "
             f"device(s){', ' + mode if mode else ''}; best of {args.rounds} rounds x "
             f"{args.steps} steps")
    table = Table(title=title)
    for col in ("model", "baseline", "params", "xshard ms/step", "JAX ms/step", "xshard/JAX",
                "CPU ms/step xshard, JAX", "CPU ratio", "trace ms", "sync ms",
                "timed recompiles", "max |loss diff|", "temp MiB/device xshard, JAX"):
        table.add_column(col, justify="left" if col in ("model", "baseline") else "right")
    for r in results:
        ratio = r["xshard_ms"] / r["jax_ms"]
        table.add_row(r["name"], r["baseline"], f"{r['params'] / 1e6:.1f} M", f"{r['xshard_ms']:.1f}",
                      f"{r['jax_ms']:.1f}", f"[{'green' if ratio <= 1.3 else 'red'}]{ratio:.2f}x",
                      f"{r['xshard_cpu_ms']:.0f}, {r['jax_cpu_ms']:.0f}",
                      f"{r['xshard_cpu_ms'] / r['jax_cpu_ms']:.2f}x",
                      f"{r['trace_ms']:.1f}", f"{r['sync_ms']:.1f}", str(r["recompiles"]),
                      f"{r['max_loss_diff']:.2e}",
                      "{:.1f}, {:.1f}".format(*(b / 2**20 for b in r["temp_bytes"])))
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for r in results:
        xf, xl, jf, jl = r["loss_first_last"]
        console.print(
            f"{r['name']}: per-round ms/step xshard {[round(v, 1) for v in r['xshard_ms_all']]}, "
            f"{r['baseline']} {[round(v, 1) for v in r['jax_ms_all']]}; warm-up (compiles) "
            f"{r['warmup_s'][0]:.1f} s xshard, {r['warmup_s'][1]:.1f} s {r['baseline']}; loss "
            f"{xf:.4f} -> {xl:.4f} ({r['baseline']} {jf:.4f} -> {jl:.4f})"
            + (f"; CPU fallbacks {r['fallbacks']}" if r["fallbacks"] else ""))
    console.print("ms/step: wall time (best round). CPU ms/step: CPU time of this process, all "
                  "threads (best round; steadier than wall time when other processes share the "
                  "machine). trace ms: host time recording one step (forward, backward, "
                  "optimizer); sync ms: host time in xshard.sync() (graph build, cache lookup, "
                  "dispatch). temp MiB/device: XLA's memory analysis of the compiled step "
                  "(temporaries: activations, gathered parameters, gradients before they are "
                  "reduced). Target: GPT xshard/JAX <= 1.3x.")


def main(args):
    results = [r for case in make_cases(args) for r in run_case(case, args)]
    print_results(results, args)
    return results


if __name__ == "__main__":
    main(ARGS)
