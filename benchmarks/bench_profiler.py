"""What profiling support costs: with no trace active (the usual case), and while tracing.

Records training steps of ``xshard.models.GPT`` (as ``bench_tracing.py`` does) and reports:

- the per-op hook (``if trace.OPEN is None`` in ``tensor.dispatch``): ns per aten call, timed in
  a tight loop, and its share of a step's recording time;
- xshard's phases (span + metric) per sync and per transfer, ``Trace`` / ``StepTrace`` spans: µs
  per enter/exit with no trace active;
- a step's recording and sync host time with no trace active and while a trace is collected
  (interleaved, same process; thread CPU time, less disturbed by other processes).

Usage:
    python benchmarks/bench_profiler.py                 # GPT 8L d512 (29.5 M parameters)
    python benchmarks/bench_profiler.py --layers 2 --embd 128 --vocab 512 --block 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_tracing  # noqa: E402
import xshard  # noqa: E402
import xshard.profiler as xp  # noqa: E402
from xshard.core import tensor, trace  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds, traced and not")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    args.steps, args.warmup, args.profile = 1, 3, 0
    return args


def per_call_ns(fn, n=200_000) -> float:
    """Median over 5 runs of ``fn(n)``'s thread CPU time per iteration, in ns."""
    runs = []
    for _ in range(5):
        start = time.thread_time_ns()
        fn(n)
        runs.append((time.thread_time_ns() - start) / n)
    return statistics.median(runs)


def hook_loop(n):
    module = tensor.trace  # the same lookups tensor.dispatch() makes
    for _ in range(n):
        if module.OPEN is None:
            module.recording_op()


def empty_loop(n):
    for _ in range(n):
        pass


def phase_loop(n):
    for _ in range(n):
        with trace.phase(trace.BUILD_GRAPH):
            pass


def trace_span_loop(n):
    span = xp.Trace("x")
    for _ in range(n):
        with span:
            pass


def timed_step(trainer) -> tuple[float, float]:
    """(recording, sync) thread CPU seconds of one step; waits for it to finish."""
    start = time.thread_time()
    trainer.trace()
    traced = time.thread_time()
    xshard.sync()
    synced = time.thread_time()
    xshard.wait()
    return traced - start, synced - traced


def main(args):
    trainer = bench_tracing.Trainer(args)
    for _ in range(args.warmup):
        trainer.trace()
        xshard.sync(wait=True)
    aten_calls = bench_tracing.count_aten_calls(trainer)
    xshard.sync(wait=True)

    trace.recording_op()  # no trace active: OPEN becomes _NOT_TRACING, as between boundaries
    hook = per_call_ns(hook_loop) - per_call_ns(empty_loop)
    phase = per_call_ns(phase_loop, 50_000) - per_call_ns(empty_loop)
    span = per_call_ns(trace_span_loop, 50_000) - per_call_ns(empty_loop)

    plain, traced = [], []
    with tempfile.TemporaryDirectory() as logdir:
        for _ in range(args.rounds):
            plain.append(timed_step(trainer))
            xp.start_trace(logdir)
            traced.append(timed_step(trainer))
            xp.stop_trace()
    med = statistics.median
    rec, syn = med(r for r, _ in plain), med(s for _, s in plain)
    trec, tsyn = med(r for r, _ in traced), med(s for _, s in traced)
    cfg = trainer.cfg
    print(f"GPT {cfg.n_layer}L d{cfg.n_embd} V{cfg.vocab_size} T{cfg.block_size}: "
          f"{aten_calls} aten calls per step; median of {args.rounds} interleaved rounds "
          f"(thread CPU time)")
    print(f"  per-op hook, no trace active: {hook:6.1f} ns per aten call = "
          f"{hook * aten_calls / 1e6:.3f} ms per step = {hook * aten_calls / (rec * 1e9):.3%} of "
          f"recording")
    print(f"  phase (span + metric), no trace: {phase / 1e3:5.2f} µs each (3 per sync: sync, "
          f"build_graph, execute; 1 per transfer)")
    print(f"  Trace() enter+exit, no trace:    {span / 1e3:5.2f} µs")
    print(f"  not traced: record {rec * 1e3:7.1f} ms/step, sync {syn * 1e3:6.1f} ms/step")
    print(f"  traced:     record {trec * 1e3:7.1f} ms/step ({trec / rec:.2f}x), sync "
          f"{tsyn * 1e3:6.1f} ms/step ({tsyn / syn:.2f}x)")


if __name__ == "__main__":
    main(parse_args())
