"""Costs of running as several processes: launcher start-up, the per-sync check, uploads.

Runs itself through ``xshard.launch`` as 2 processes x 4 CPU devices (loopback) and reports:

- start-up: launcher start to every process past ``xshard.initialize()`` (imports included), and
  ``initialize()`` alone;
- the divergence check per sync: a steady loop of a small cached program, ``sync(wait=True)`` per
  step, timed with the check (``XSHARD_CHECK=always``) and without it (``off``, a second launch);
  the difference is the check's cost. The key-value exchange alone is timed as well;
- uploads of a replicated (256, 256) float32 tensor: ``jax.device_put`` of the host data (what
  xshard did before: a hidden cross-process equality check) against ``arrays.put``
  (``make_array_from_callback`` plus the sampled digest).

Usage:
    python benchmarks/bench_multihost.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(steps: int) -> None:
    import numpy as np
    import torch

    import xshard
    from xshard.core import arrays, divergence, execute, runtime

    begin = time.perf_counter()
    xshard.initialize()
    init_s = time.perf_counter() - begin
    import xshard.spmd as xs

    dev = xshard.device()
    mesh = xs.Mesh(np.arange(xshard.device_count()), (xshard.device_count(),), ("x",))
    w = torch.ones(64, 64).to(dev)
    xs.mark_sharding(w, mesh, ("x", None))
    for _ in range(5):  # warm: compiled, cached
        w.mul_(1.0001)
        xshard.sync(wait=True)
    times = []
    for _ in range(steps):
        w.mul_(1.0001)
        t = time.perf_counter()
        xshard.sync(wait=True)
        times.append(time.perf_counter() - t)
    out = {"rank": xshard.process_index(), "init_s": init_s,
           "ready_at": time.time(), "sync_ms": statistics.median(times) * 1e3}
    if runtime.distributed_settings().check != "off":
        exchange = []
        for _ in range(steps):
            t = time.perf_counter()
            divergence.exchange("bench", "x")
            exchange.append(time.perf_counter() - t)
        out["exchange_ms"] = statistics.median(exchange) * 1e3
        jax = runtime.jax_module()
        host = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
        sharding = execute.default_sharding()
        for name, fn in (("device_put", lambda: jax.device_put(host, sharding)),
                         ("arrays.put", lambda: arrays.put(host, sharding))):
            fn().block_until_ready()
            t = time.perf_counter()
            for _ in range(50):
                fn().block_until_ready()
            out[f"upload_ms_{name}"] = (time.perf_counter() - t) / 50 * 1e3
        divergence._take_uploads()
    print("RESULT " + json.dumps(out), flush=True)


def launch(steps: int, check: str) -> tuple[float, list[dict]]:
    env = dict(os.environ, XSHARD_CHECK=check, PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
    start = time.time()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "xshard", "launch.py"), "--nproc",
                          "2", "--cpu-devices", "4", "--timeout", "300", __file__, "--worker",
                          "--steps", str(steps)], env=env, capture_output=True, text=True,
                         timeout=330)
    if run.returncode:
        sys.exit(f"launch failed ({run.returncode}):\n{run.stderr[-4000:]}")
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines()
               if "RESULT " in line]
    return start, sorted(results, key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps)
        return
    start, on = launch(args.steps, "always")
    _, off = launch(args.steps, "off")
    print(f"2 processes x 4 CPU devices, loopback, {args.steps} syncs; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"start-up: launcher to every process initialised {max(r['ready_at'] for r in on) - start:.2f} s "
          f"(initialize() alone {max(r['init_s'] for r in on):.2f} s)")
    for r_on, r_off in zip(on, off):
        print(f"process {r_on['rank']}: sync(wait=True) of a cached program {r_on['sync_ms']:.2f} ms "
              f"with the check, {r_off['sync_ms']:.2f} ms without (check ≈ "
              f"{r_on['sync_ms'] - r_off['sync_ms']:.2f} ms); key-value exchange alone "
              f"{r_on['exchange_ms']:.2f} ms")
        print(f"process {r_on['rank']}: replicated (256, 256) float32 upload: jax.device_put "
              f"{r_on['upload_ms_device_put']:.2f} ms, arrays.put "
              f"{r_on['upload_ms_arrays.put']:.3f} ms")


if __name__ == "__main__":
    main()
