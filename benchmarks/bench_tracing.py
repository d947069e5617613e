"""Tracing cost of a GPT-style training step: microseconds of host time per recorded op.

Records whole training steps (forward, ``loss.backward()``, ``torch.optim.AdamW.step()``,
``zero_grad``) of ``xshard.models.GPT`` and reports, after warm-up (meta-kernel and executable caches
full, optimizer state created):

- trace ms/step: host time to record one step, nothing run;
- µs per aten op: that time divided by the aten calls reaching ``XTensor.__torch_dispatch__``
  (counted in a separate, untimed step, so counting costs nothing in the timed ones);
- µs per IR node: the same time divided by the op nodes of the step's graph (what ``sync()`` compiles);
- sync ms, split into graph build (linearise + structural key), executable cache lookup and dispatch.

Each step's execution is waited for before the next step is traced, so tracing is timed alone, not
competing with XLA for the CPU (``bench_step.py`` measures the overlapped steady state).

Usage:
    python benchmarks/bench_tracing.py                    # GPT 8L d512 (29.5 M parameters)
    python benchmarks/bench_tracing.py --profile 25       # plus cProfile's top 25 of trace and sync
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile one step with cProfile and print the top N functions")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 2:
        p.error("--steps must be >= 1 and --warmup >= 2 (AdamW's first step differs)")
    return args


import torch  # noqa: E402

import xshard  # noqa: E402
from xshard.core import compiler, execute, ir  # noqa: E402
from xshard.core import tensor as xtensor  # noqa: E402
from xshard.core.graph import Graph  # noqa: E402
from xshard.models.gpt import GPT, GPTConfig  # noqa: E402


class Trainer:
    def __init__(self, args):
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers,
                        n_head=args.heads, n_embd=args.embd)
        torch.manual_seed(0)
        dev = xshard.device()
        self.cfg = cfg
        self.model = GPT(cfg).to(dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size)).to(dev)
        self.y = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size)).to(dev)
        xshard.sync(wait=True)

    def trace(self):
        loss = self.model(self.x, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


# -- counting ----------------------------------------------------------------------------------


def count_aten_calls(trainer: Trainer) -> int:
    """Aten calls that reach ``__torch_dispatch__`` while one step is recorded (nested ones included)."""
    original = xtensor.dispatch
    calls = 0

    def counting(func, args, kwargs):
        nonlocal calls
        calls += 1
        return original(func, args, kwargs)

    xtensor.dispatch = counting
    try:
        trainer.trace()
    finally:
        xtensor.dispatch = original
    return calls


def pending_graph() -> Graph:
    """The graph ``sync()`` would build now."""
    return execute.pending_step().graph


def op_nodes(g: Graph) -> int:
    return sum(1 for n in g.order if n.op is not ir.DATA and n.op is not ir.SCALAR)


# -- timing sync() by phase -------------------------------------------------------------------------


class SyncPhases:
    """Wraps ``Graph`` and ``compiler.executable`` (the names ``sync()`` calls) with timers."""

    def __init__(self):
        self.build = self.lookup = 0.0

    def __enter__(self):
        self._graph, self._executable = execute.Graph, compiler.executable
        phases = self

        def timed_graph(*a, **k):
            start = time.perf_counter()
            try:
                return phases._graph(*a, **k)
            finally:
                phases.build += time.perf_counter() - start

        def timed_executable(g, *a):
            start = time.perf_counter()
            try:
                return phases._executable(g, *a)
            finally:
                phases.lookup += time.perf_counter() - start

        execute.Graph, compiler.executable = timed_graph, timed_executable
        return self

    def __exit__(self, *exc):
        execute.Graph, compiler.executable = self._graph, self._executable


# -- main --------------------------------------------------------------------------------------------


def profile_step(trainer: Trainer, top: int) -> str:
    out = io.StringIO()
    for label, fn in (("trace", trainer.trace), ("sync", xshard.sync)):
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        out.write(f"\n=== cProfile of one step: {label} (sorted by own time) ===\n")
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        out.write(f"\n=== {label}: by cumulative time ===\n")
        stats.sort_stats("cumulative").print_stats(top)
    xshard.wait()
    return out.getvalue()


def main(args):
    trainer = Trainer(args)
    for _ in range(args.warmup):
        trainer.trace()
        xshard.sync(wait=True)

    aten_calls = count_aten_calls(trainer)
    g = pending_graph()
    nodes, inputs = op_nodes(g), len(g.inputs)
    xshard.sync(wait=True)

    trace_s, trace_cpu_s, sync_s, sync_cpu_s = [], [], [], []
    build_s, lookup_s, execute_s, rest_s = [], [], [], []
    before = xshard.metrics.snapshot()
    for _ in range(args.steps):
        cpu_start = time.thread_time()
        start = time.perf_counter()
        trainer.trace()
        traced = time.perf_counter()
        trace_cpu_s.append(time.thread_time() - cpu_start)
        exec_before = xshard.metrics.METRICS.execute_seconds
        sync_cpu_start = time.thread_time()
        with SyncPhases() as phases:
            xshard.sync()
        synced = time.perf_counter()
        sync_cpu_s.append(time.thread_time() - sync_cpu_start)
        xshard.wait()
        trace_s.append(traced - start)
        sync_s.append(synced - traced)
        build_s.append(phases.build)
        lookup_s.append(phases.lookup)
        execute_s.append(xshard.metrics.METRICS.execute_seconds - exec_before)
        rest_s.append(sync_s[-1] - build_s[-1] - lookup_s[-1] - execute_s[-1])
    after = xshard.metrics.snapshot()

    med = statistics.median
    trace = med(trace_s)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    cfg = trainer.cfg
    print(f"GPT {cfg.n_layer}L d{cfg.n_embd} h{cfg.n_head} V{cfg.vocab_size} T{cfg.block_size} "
          f"batch {args.batch}: {n_params / 1e6:.1f} M parameters, "
          f"{len(list(trainer.model.parameters()))} parameter tensors; median of {args.steps} steps")
    print(f"  recorded per step:  {aten_calls} aten calls, {nodes} IR op nodes, {inputs} graph inputs")
    trace_cpu = med(trace_cpu_s)
    print(f"  trace (wall):       {trace * 1e3:8.1f} ms/step  "
          f"({trace / aten_calls * 1e6:.1f} µs per aten call, {trace / nodes * 1e6:.1f} µs per IR node)")
    print(f"  trace (thread CPU): {trace_cpu * 1e3:8.1f} ms/step  "
          f"({trace_cpu / aten_calls * 1e6:.1f} µs per aten call, "
          f"{trace_cpu / nodes * 1e6:.1f} µs per IR node; unaffected by other processes)")
    print(f"  sync (host):        {med(sync_s) * 1e3:8.1f} ms/step  = graph build "
          f"{med(build_s) * 1e3:.1f} ms + cache lookup {med(lookup_s) * 1e3:.2f} ms + dispatch "
          f"{med(execute_s) * 1e3:.1f} ms + rest (inputs, write-back) {med(rest_s) * 1e3:.1f} ms")
    print(f"  sync (thread CPU):  {med(sync_cpu_s) * 1e3:8.1f} ms/step")
    print(f"  host total:         {(trace + med(sync_s)) * 1e3:8.1f} ms/step; compiles in timed steps: "
          f"{after['compiles'] - before['compiles']}, cache hits: "
          f"{after['cache_hits'] - before['cache_hits']}")
    if args.profile:
        print(profile_step(trainer, args.profile))


if __name__ == "__main__":
    main(parse_args())
