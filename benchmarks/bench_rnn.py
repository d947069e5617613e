"""nn.LSTM training steps: xshard's scan per layer against PyTorch's unrolled composite.

Both sides train the same ``nn.LSTM`` (forward, backward, SGD step, ``xshard.sync(wait=True)``) in this
process, from identical weights on identical batches. The scan side is what ``nn.LSTM`` records on
xshard (one ``xshard::rnn_layer`` per layer and direction, lowered to ``jax.lax.scan``); the baseline
runs PyTorch's own composite ``aten::lstm`` definition (``aten.lstm.input.decompose``), which unrolls
the sequence into per-step matmuls and fused cells (``_thnn_fused_lstm_cell`` and its backward).

Printed per sequence length: HLO lines of the forward, compile seconds (first step), seconds per steady
step (median of ``--steps``), and the largest output difference between the two sides.

Usage:
    python benchmarks/bench_rnn.py                       # 1 CPU device
    python benchmarks/bench_rnn.py --lengths 16 64 256 --hidden 256 --layers 2
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=1, help="virtual CPU devices (on CPU)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--bidirectional", action="store_true")
    p.add_argument("--steps", type=int, default=5, help="timed steady steps per side")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("XSHARD_CPU_DEVICES", str(args.devices))
    import torch

    import xshard
    from xshard import metrics

    aten = torch.ops.aten
    dev = xshard.device()

    def unrolled(module, x):
        # PyTorch's composite definition of aten::lstm, run with autograd: per-step fused cells.
        d = 2 if module.bidirectional else 1
        h = torch.zeros(module.num_layers * d, x.shape[1], module.hidden_size, device=x.device)
        return aten.lstm.input.decompose(x, [h, h], module._flat_weights, module.bias,
                                         module.num_layers, 0.0, True, module.bidirectional,
                                         False)[0]

    def scan(module, x):
        return module(x)[0]

    torch.manual_seed(0)
    ref = torch.nn.LSTM(args.features, args.hidden, num_layers=args.layers,
                        bidirectional=args.bidirectional)
    print(f"nn.LSTM({args.features}, {args.hidden}, num_layers={args.layers}, bidirectional="
          f"{args.bidirectional}), batch {args.batch}; {xshard.device_count()} device(s)")
    print(f"{'length':>6} {'side':>8} {'fwd HLO':>9} {'compile s':>9} {'step s':>8} "
          f"{'max |diff|':>10}")
    for length in args.lengths:
        x = torch.randn(length, args.batch, args.features).to(dev)
        outs = {}
        for name, forward in (("unrolled", unrolled), ("scan", scan)):
            module = copy.deepcopy(ref).to(dev)
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)

            def step():
                out = forward(module, x)
                out.square().mean().backward()
                opt.step()
                opt.zero_grad()
                return out

            out = forward(module, x)
            lines = len(xshard.debug.hlo_text([out]).splitlines())
            del out
            xshard.sync(wait=True)
            before = metrics.snapshot()["compile_seconds"]
            step()
            xshard.sync(wait=True)
            compile_s = metrics.snapshot()["compile_seconds"] - before
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = step()
                xshard.sync(wait=True)
                times.append(time.perf_counter() - t0)
            outs[name] = out.detach().cpu()
            diff = (outs[name] - outs["unrolled"]).abs().max().item()
            print(f"{length:>6} {name:>8} {lines:>9} {compile_s:>9.2f} "
                  f"{statistics.median(times):>8.4f} {diff:>10.2e}")


if __name__ == "__main__":
    main()
