"""Compiled training step (``xshard.compile``) against the same model in pure JAX, side by side.

Both sides run in this process on the same virtual CPU devices, from identical weights, on identical
batches, with the same shardings:

- xshard: ``xshard.models.GPT`` and ``torch.optim.AdamW``; ``step = xshard.compile(train_step)``
  where ``train_step(x, y)`` runs the forward, ``loss.backward()``, ``opt.step()`` and
  ``opt.zero_grad()``. After the first calls (recording and compiling) a call reads the state's
  arrays, calls one executable and writes the results back;
- JAX: ``benchmarks/jax_models.py``: one ``jax.jit`` step (value_and_grad + hand-written AdamW)
  with donated parameters and optimizer state;
- optionally (``--lazy``) xshard's lazy path: the same PyTorch loop with ``xshard.sync()``.

Layouts (8 devices):

- ``fsdp``: xshard wraps the model in ``xshard.fsdp.FSDP`` (one unit per block, its defaults: each
  unit's gradients reduced by one reduce-scatter, see [Note: FSDP gradient buckets]); JAX shards
  every parameter and optimizer moment over an ``fsdp`` axis on its largest dimension, splits the
  batch over it and pins the activations to the batch sharding (JAX's FSDP idiom; see
  bench_step.py);
- ``fsdp-free``: the same without FSDP's optimization barriers (``optimization_barrier_in_forward``
  and ``..._in_backward`` False): XLA schedules the gathers freely, as it does for the JAX program,
  at the cost of gathered parameters alive at once (see [Note: FSDP without barriers] in
  xshard/fsdp/fully_shard.py);
- ``fsdp-keep``: FSDP with its barriers and ``reshard_after_forward=False``: each unit's gathered
  parameters are kept from its forward to its backward instead of gathered again, as XLA does for
  the JAX program (it gathers each parameter once per step), at the cost of every unit's gathered
  parameters alive from forward to backward;
- ``2d``: a (data 4, model 2) mesh: the batch split over ``data``; each block's ``qkv`` and
  ``mlp.fc`` split by rows and its ``attn.proj`` and ``mlp.proj`` by columns over ``model``
  (Megatron-style); xshard annotates them with ``mark_sharding``, JAX places them so; the
  partitioner does the rest on both sides.

Warm-up steps (which record and compile) are not timed. The timed region is ``--rounds``
alternating rounds of ``--steps`` steps per side, each ending by blocking on the results, so both
sides see the same machine load; the best round is reported. Host time per step is the wall time
spent inside the step call (xshard: ``step(x, y)``; JAX: the jitted call, host scalars included),
and the CPU time of this thread in it; for xshard it is split into the executable call (JAX's
dispatch, the same work as JAX's own call) and xshard's own Python around it.

Usage:
    python benchmarks/bench_compile.py                       # both GPTs, every layout
    python benchmarks/bench_compile.py --model small --mode 2d --steps 10
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass, field

SIZES = {
    # name: (layers, d_model, heads, seq, vocab, batch)
    "small": (2, 128, 4, 64, 1024, 16),
    "21m": (4, 512, 8, 256, 8192, 16),  # 16.9 M parameters, 21.1 M counting the tied head twice
    "tiny": (2, 32, 2, 16, 128, 8),  # for tests (tests/benchmarks)
}


LAYOUTS = ("fsdp", "fsdp-free", "fsdp-keep", "2d")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=(*SIZES, "all"), default="all",
                   help="all: small and 21m")
    p.add_argument("--mode", choices=(*LAYOUTS, "all"), default="all")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per side")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (the first three record and compile)")
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    p.add_argument("--lazy", action="store_true", help="also time xshard's lazy path")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 3:
        p.error(f"--warmup must be at least 3 (the first step creates the optimizer state, the "
                f"second records the steady step, the third compiles its packed form: see "
                f"[Note: packed state] in xshard/step/packing.py), got {args.warmup}")
    if args.devices < 8:
        p.error("--devices: the FSDP and (4, 2) meshes need 8 devices")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["XSHARD_CPU_DEVICES"] = str(ARGS.devices)  # read once, before JAX starts

import numpy as np  # noqa: E402
import torch  # noqa: E402

import xshard  # noqa: E402
import xshard.spmd as xs  # noqa: E402
from xshard.fsdp import FSDP, transformer_auto_wrap_policy  # noqa: E402
from xshard.mesh import Mesh  # noqa: E402
from xshard.models.gpt import GPT, Block, GPTConfig  # noqa: E402

jax = xshard.runtime.jax_module()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax_models as jm  # noqa: E402

P = jax.sharding.PartitionSpec


def two_d_spec(name: str, ndim: int) -> tuple:
    """The (data, model) layout of a GPT parameter: Megatron-style splits over ``model``."""
    if name.endswith(("attn.qkv.weight", "mlp.fc.weight")):
        return ("model", None)
    if name.endswith(("attn.qkv.bias", "mlp.fc.bias")):
        return ("model",)
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return (None, "model")
    return (None,) * ndim


def fsdp_spec(shape) -> tuple:
    """Over ``fsdp`` on the largest dimension, as xshard's FSDP shards a parameter."""
    if not shape:
        return ()
    dim = max(range(len(shape)), key=lambda d: (shape[d], -d))
    return tuple("fsdp" if d == dim else None for d in range(len(shape)))


@dataclass
class Timing:
    step_ms: list = field(default_factory=list)  # per round: wall ms per step
    host_ms: list = field(default_factory=list)  # per round: wall ms inside the step call
    cpu_ms: list = field(default_factory=list)  # per round: this thread's CPU ms in the call
    exe_ms: list = field(default_factory=list)  # per round (xshard): CPU ms in the executable call
    proc_ms: list = field(default_factory=list)  # per round: this process's CPU ms per step
    losses: list = field(default_factory=list)


class _Clock:
    """Wall and thread CPU time spent inside calls of ``fn``."""

    def __init__(self, fn):
        self.fn, self.wall, self.cpu = fn, 0.0, 0.0

    def __call__(self, *args):
        w, c = time.perf_counter(), time.thread_time()
        out = self.fn(*args)
        self.cpu += time.thread_time() - c
        self.wall += time.perf_counter() - w
        return out


# -- xshard ---------------------------------------------------------------------------------------


class XShardRunner:
    def __init__(self, cfg, batches, mode: str, args, compiled: bool):
        torch.manual_seed(args.seed)
        model = GPT(cfg)
        self.initial = jm.params_from_torch(model)
        self.params = sum(p.numel() for p in model.parameters())
        dev = xshard.device()
        if mode.startswith("fsdp"):
            fenced = mode != "fsdp-free"
            model = FSDP(model, auto_wrap_policy=functools.partial(
                transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                optimization_barrier_in_forward=fenced, optimization_barrier_in_backward=fenced,
                reshard_after_forward=mode != "fsdp-keep")
            mesh, data_spec = model.mesh, ("fsdp", None)
        else:
            mesh = Mesh(range(8), (4, 2), ("data", "model"))
            model = model.to(dev)
            for name, p in model.named_parameters():
                spec = two_d_spec(name, p.dim())
                if any(spec):
                    xs.mark_sharding(p, mesh, spec)
            data_spec = ("data", None)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        self.batches = []
        for x, y in batches:
            xd, yd = x.to(dev), y.to(dev)
            xs.mark_sharding(xd, mesh, data_spec)
            xs.mark_sharding(yd, mesh, data_spec)
            self.batches.append((xd, yd))
        xshard.sync(wait=True)
        self.compiled = compiled
        if compiled:
            self.step_fn = xshard.compile(self.train_step)
        self.next = 0
        self.timing = Timing()
        self.recompiles = 0
        self._loss_tensors = []

    def train_step(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def step(self):
        x, y = self.batches[self.next]
        self.next += 1
        if self.compiled:
            loss = self.step_fn(x, y)
        else:
            loss = self.train_step(x, y)
            xshard.sync()
        # A replay's loss holds no autograd graph: detaching it would time one more op.
        self._loss_tensors.append(loss.detach() if loss.requires_grad else loss)

    def warmup(self, n):
        for _ in range(n):
            self.step()
        xshard.wait()

    def timed(self, n):
        clock = _Clock(self.step)
        exe = None
        if self.compiled:  # time the executable call inside the step too
            program = self.step_fn._last
            exe = program.compiled = _Clock(program.compiled)
        before = xshard.metrics.snapshot()["compiles"]
        start, proc = time.perf_counter(), time.process_time()
        for _ in range(n):
            clock()
        xshard.wait()
        self.timing.step_ms.append((time.perf_counter() - start) / n * 1e3)
        self.timing.proc_ms.append((time.process_time() - proc) / n * 1e3)
        self.timing.host_ms.append(clock.wall / n * 1e3)
        self.timing.cpu_ms.append(clock.cpu / n * 1e3)
        if exe is not None:
            self.timing.exe_ms.append(exe.cpu / n * 1e3)
            self.step_fn._last.compiled = exe.fn
        self.recompiles += xshard.metrics.snapshot()["compiles"] - before

    def losses(self):
        return [float(t.item()) for t in self._loss_tensors]


# -- JAX ------------------------------------------------------------------------------------------


class JaxRunner(jm.TrainLoop):
    def __init__(self, cfg, batches, initial: dict, mode: str, args):
        devices = xshard.runtime.devices()[:8]
        if mode.startswith("fsdp"):
            mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
            spec_of = lambda name, a: fsdp_spec(a.shape)  # noqa: E731
            batch = jax.sharding.NamedSharding(mesh, P("fsdp", None))
            activation = jax.sharding.NamedSharding(mesh, P("fsdp"))
        else:
            mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
            spec_of = lambda name, a: two_d_spec(name, a.ndim)  # noqa: E731
            batch = jax.sharding.NamedSharding(mesh, P("data", None))
            activation = None
        shardings = {k: jax.sharding.NamedSharding(mesh, P(*spec_of(k, a)))
                     for k, a in initial.items()}
        params = {k: jax.device_put(np.asarray(a), shardings[k]) for k, a in initial.items()}
        state = {m: {k: jax.device_put(np.zeros(a.shape, np.float32), shardings[k])
                     for k, a in initial.items()} for m in ("exp_avg", "exp_avg_sq")}
        placed = [(jax.device_put(x.numpy(), batch), jax.device_put(y.numpy(), batch))
                  for x, y in batches]
        super().__init__(params, state, placed, jm.gpt_loss_fn(cfg, activation_sharding=activation),
                         jm.AdamW(lr=args.lr), (batch, batch))
        self.timing = Timing()

    def warmup(self, n):
        for _ in range(n):
            self.step()
        self.block()

    def timed(self, n):
        clock = _Clock(self.step)
        start, proc = time.perf_counter(), time.process_time()
        for _ in range(n):
            clock()
        self.block()
        self.timing.step_ms.append((time.perf_counter() - start) / n * 1e3)
        self.timing.proc_ms.append((time.process_time() - proc) / n * 1e3)
        self.timing.host_ms.append(clock.wall / n * 1e3)
        self.timing.cpu_ms.append(clock.cpu / n * 1e3)


# -- main -----------------------------------------------------------------------------------------


def run_case(size: str, mode: str, args) -> dict:
    layers, d, heads, seq, vocab, batch = SIZES[size]
    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d)
    n_batches = args.warmup + args.steps * args.rounds
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [(torch.randint(0, vocab, (batch, seq), generator=gen),
                torch.randint(0, vocab, (batch, seq), generator=gen)) for _ in range(n_batches)]
    compiled = XShardRunner(cfg, batches, mode, args, compiled=True)
    runners = {"xshard.compile": compiled,
               "JAX": JaxRunner(cfg, batches, compiled.initial, mode, args)}
    if args.lazy:
        runners["xshard lazy"] = XShardRunner(cfg, batches, mode, args, compiled=False)
    del compiled.initial
    warm = {}
    for label, r in runners.items():
        start = time.perf_counter()
        r.warmup(args.warmup)
        warm[label] = time.perf_counter() - start
    for _ in range(args.rounds):
        for r in runners.values():
            r.timed(args.steps)
    x_losses, j_losses = compiled.losses(), runners["JAX"].losses()
    return {
        "name": f"GPT {layers}L d{d} T{seq} V{vocab} b{batch}", "mode": mode,
        "params": compiled.params, "runners": runners, "warmup_s": warm,
        "recordings": compiled.step_fn.traces, "timed_recompiles": compiled.recompiles,
        "max_loss_diff": max(abs(a - b) for a, b in zip(x_losses, j_losses)),
        "losses": (x_losses[0], x_losses[-1], j_losses[0], j_losses[-1]),
    }


def _best(t: Timing, key: str):
    values = getattr(t, key)
    best = t.step_ms.index(min(t.step_ms))
    return values[best] if values else float("nan")


def print_results(results, args):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"xshard.compile vs pure JAX, GPT + AdamW training step, {args.devices} "
                        f"virtual CPU devices; best of {args.rounds} alternating rounds x "
                        f"{args.steps} steps, one invocation")
    for col in ("model", "layout", "params", "side", "ms/step", "vs JAX", "process CPU ms/step",
                "CPU vs JAX", "host ms/step", "host CPU ms", "in executable CPU ms",
                "xshard Python CPU ms"):
        table.add_column(col, justify="left" if col in ("model", "layout", "side") else "right")
    for r in results:
        jax_ms = min(r["runners"]["JAX"].timing.step_ms)
        jax_cpu = min(r["runners"]["JAX"].timing.proc_ms)
        for label, runner in r["runners"].items():
            t = runner.timing
            ms = min(t.step_ms)
            exe = _best(t, "exe_ms") if label == "xshard.compile" else float("nan")
            host = _best(t, "host_ms")
            host_cpu = _best(t, "cpu_ms")
            ratio = ms / jax_ms
            color = "green" if ratio <= 1.1 else "red"
            table.add_row(r["name"], r["mode"], f"{r['params'] / 1e6:.1f} M", label, f"{ms:.1f}",
                          f"[{color}]{ratio:.2f}x" if label != "JAX" else "",
                          f"{min(t.proc_ms):.0f}",
                          f"{min(t.proc_ms) / jax_cpu:.2f}x" if label != "JAX" else "",
                          f"{host:.2f}", f"{host_cpu:.2f}",
                          f"{exe:.2f}" if exe == exe else "",
                          f"{host_cpu - exe:.2f}" if exe == exe else "")
    console = Console(width=None if sys.stdout.isatty() else 220)
    console.print(table)
    for r in results:
        xf, xl, jf, jl = r["losses"]
        rounds = {k: [round(v, 1) for v in run.timing.step_ms] for k, run in r["runners"].items()}
        console.print(
            f"{r['name']} {r['mode']}: per-round ms/step {rounds}; recordings "
            f"{r['recordings']}, compiles during timed rounds {r['timed_recompiles']}; warm-up "
            f"{ {k: round(v, 1) for k, v in r['warmup_s'].items()} } s; loss {xf:.4f} -> {xl:.4f} "
            f"(JAX {jf:.4f} -> {jl:.4f}), max |loss diff| {r['max_loss_diff']:.2e}")
    console.print(
        "ms/step: wall time per step (best round). process CPU ms/step: CPU time of this process, "
        "all threads (best round; steadier than wall time when other processes load the machine). "
        "host ms/step: wall time inside the step call (it waits when the devices are busy); host "
        "CPU ms: this thread's CPU time in it; in executable CPU ms: the part inside the compiled "
        "executable's call (JAX's dispatch: argument handling, launching); xshard Python CPU ms: "
        "the rest (guard, reading inputs, storing results, freeing the consumed buffers, which "
        "JAX's own step call also does). Target: "
        "xshard.compile within 1.1x of JAX on every row, host time per step under 1 ms.")


def main(args):
    sizes = ["small", "21m"] if args.model == "all" else [args.model]
    modes = list(LAYOUTS) if args.mode == "all" else [args.mode]
    results = [run_case(size, mode, args) for size in sizes for mode in modes]
    print_results(results, args)
    return results


if __name__ == "__main__":
    main(ARGS)
