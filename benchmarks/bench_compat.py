"""What ``xm.optimizer_step``'s gradient all-reduce costs per step between ``xmp.spawn`` replicas.

Runs itself through ``python -m xshard.compat`` as 2 replicas (``xmp.spawn(nprocs=2)``, one CPU
device each, loopback), twice: with the pre-collective check (``XSHARD_CHECK=always``, the default)
and without it (``off``). For two models (the test's small BatchNorm CNN, 3.5 K parameters, and an
MLP of 4 x 1024 x 1024, 4.2 M parameters) each replica times, as medians over steady steps:

- ``local``: forward, backward, ``optimizer.step()`` and ``xm.mark_step(wait=True)``: a replica
  alone (no gradient exchange: wrong numbers, the baseline);
- ``xm``: the same with ``xm.optimizer_step(optimizer)``: the all-reduce (one jitted shard_map
  psum over every gradient, JAX's gloo collectives on CPU) between backward and step;
- ``reduce``: ``xm.reduce_gradients`` alone, on gradients already computed (one collective
  program, waited for);
- ``gloo``: the alternative of reducing CPU copies: read every gradient to the host, one
  ``torch.distributed.all_reduce`` (gloo) of their concatenation, copy the results back.

Usage:
    python benchmarks/bench_compat.py [--steps 30]
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


def _models():
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "compat", "scripts"))
    import mp_cnn

    mlp = torch.nn.Sequential(*[m for _ in range(4)
                                for m in (torch.nn.Linear(1024, 1024), torch.nn.ReLU())])
    return {"cnn_3.5K": (mp_cnn.Net(), (8, 1, 8, 8), 10),
            "mlp_4.2M": (mlp, (32, 1024), 1024)}


def _gloo_reduce(optimizer, world: int) -> None:
    import torch
    import torch.distributed as dist

    from xshard.core import api

    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    flat = torch.cat([api.to_cpu(g).reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.mul_(1.0 / world)
    offset = 0
    for g in grads:
        api.write(g, api.upload(flat[offset:offset + g.numel()].reshape(g.shape).clone()))
        offset += g.numel()


def _replica(index: int, steps: int) -> None:
    import torch

    import torch_xla.core.xla_model as xm

    dev = xm.xla_device()
    out = {"index": index}
    for name, (model, shape, classes) in _models().items():
        torch.manual_seed(0)
        model = model.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(shape).to(dev)
        y = torch.randint(0, classes, (shape[0],)).to(dev)

        def step(kind):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if kind == "xm":
                xm.optimizer_step(opt)
            elif kind == "gloo":
                _gloo_reduce(opt, xm.xrt_world_size())
                opt.step()
            else:
                opt.step()
            xm.mark_step(wait=True)

        for kind in ("local", "xm", "gloo"):
            for _ in range(3):
                step(kind)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                step(kind)
                times.append(time.perf_counter() - t)
            out[f"{name}/{kind}_ms"] = statistics.median(times) * 1e3
        times = []
        for _ in range(steps):
            xm.wait_device_ops()
            t = time.perf_counter()
            xm.reduce_gradients(opt)
            xm.wait_device_ops()
            times.append(time.perf_counter() - t)
        out[f"{name}/reduce_ms"] = statistics.median(times) * 1e3
    print("RESULT " + json.dumps(out), flush=True)


def _run(steps: int, check: str) -> dict:
    env = dict(os.environ, XSHARD_CHECK=check, PJRT_DEVICE="CPU",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
    proc = subprocess.run([sys.executable, "-m", "xshard.compat", os.path.abspath(__file__),
                           "--replicas", "--steps", str(steps)], env=env, capture_output=True,
                          text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr[-4000:])
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line]
    return {k: max(r[k] for r in results) for k in results[0] if k != "index"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicas", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replicas:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_replica, args=(args.steps,), nprocs=2)
        return
    runs = {check: _run(args.steps, check) for check in ("always", "off")}
    print("per-step medians in ms, 2 replicas x 1 CPU device, slowest replica "
          "(check: XSHARD_CHECK before each collective)")
    print(f"{'model':10} {'check':7} {'local':>8} {'xm':>8} {'xm-local':>9} {'reduce':>8} "
          f"{'gloo':>8} {'gloo-local':>10}")
    for model in ("cnn_3.5K", "mlp_4.2M"):
        for check, r in runs.items():
            local, xm_, red, gloo = (r[f"{model}/{k}_ms"] for k in ("local", "xm", "reduce",
                                                                    "gloo"))
            print(f"{model:10} {check:7} {local:8.2f} {xm_:8.2f} {xm_ - local:9.2f} {red:8.2f} "
                  f"{gloo:8.2f} {gloo - local:10.2f}")


if __name__ == "__main__":
    main()
