"""Memory scaling studies: per-device memory of a training step by strategy, model and device count.

    python -m xshard.experiments.memory --model gpt2-small --strategy dp fsdp-transformer 2d \\
        --devices 8 64 256 --batch-per-device 1
    python -m xshard.experiments.memory --model resnet50 --strategy dp fsdp-transformer spatial \\
        --devices 8 --budget 16GiB                       # largest batch that fits, per strategy
    python -m xshard.experiments.memory --model gpt-6.7b gpt-13b gpt-30b --strategy fsdp-transformer \\
        --devices 8 64 --budget 32GiB --search model --extrapolate-layers

Every configuration is a real training step (forward, backward, optimizer step) traced under
``xshard.compile_only()`` on a mesh over the first N devices, compiled by XLA and never run: the
figures are XLA's compiled memory analysis (``xshard.memory.analyze_step``), per device. ``--run``
runs small configurations for real instead and measures them (time, live bytes, utilisation).

The command sets ``XSHARD_CPU_DEVICES`` to the largest ``--devices`` before xshard starts its
runtime (re-executing itself if xshard was imported first, as ``python -m`` does). Results are cached
in ``--cache-dir`` (a JSON file keyed by configuration), so a re-run computes only what is new.

Strategies:
    dp                replicated data parallel: parameters replicated, batch split over ``data``.
    fsdp-transformer  FSDP, one unit per transformer block (GPT) / bottleneck block (ResNet).
    fsdp-size         FSDP, size_based_auto_wrap_policy(min_num_params=--min-params).
    2d                (data, model) mesh, Megatron-style specs: column-parallel qkv/fc, row-parallel
                      projections, vocab-parallel embedding (GPT only).
    spatial           ResNet input sharded on H and W over (h, w) axes, batch over ``data``,
                      parameters replicated (ResNet only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from xshard.experiments.memory.config import MODELS, STRATEGIES, UsageError
from xshard.experiments.memory.report import (GiB, markdown_table, plot_batch, plot_models,
                                              plot_sweep, print_table, write_csv)
from xshard.experiments.memory.search import Runner, batch_search, model_search, sweep


def _size(text: str) -> int:
    from xshard.memory import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a budget must be positive, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _grid(text: str) -> tuple:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW such as 2x2, got {text!r}") from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"expected positive HxW such as 2x2, got {text!r}")
    return (h, w)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xshard-memory", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", nargs="+", default=["gpt2-small"], metavar="MODEL",
                   help=f"models: {', '.join(MODELS)} ('gpt' = custom: give --layers etc.)")
    p.add_argument("--strategy", nargs="+", default=["dp", "fsdp-transformer"], metavar="S",
                   help=f"strategies: {', '.join(STRATEGIES)}")
    p.add_argument("--devices", nargs="+", type=_positive, default=[8], metavar="N",
                   help="device counts; each configuration runs on a mesh over the first N devices")
    p.add_argument("--batch", nargs="+", type=_positive, metavar="B", help="global batch sizes")
    p.add_argument("--batch-per-device", type=_positive, metavar="B",
                   help="global batch = B x the data-parallel degree (default 1 without --batch)")
    p.add_argument("--budget", type=_size, metavar="SIZE",
                   help="per-device budget (e.g. 16GiB): search for what fits instead of sweeping")
    p.add_argument("--search", choices=("batch", "model"), default="batch",
                   help="with --budget: the largest batch (default), or the largest --model")
    p.add_argument("--max-batch", type=_positive, default=1 << 16,
                   help="upper limit of the batch search")
    g = p.add_argument_group("GPT shape (overrides the preset)")
    for name in ("layers", "width", "heads", "vocab", "seq"):
        g.add_argument(f"--{name}", type=_positive)
    p.add_argument("--image", type=_positive, help="ResNet input size (default 224)")
    p.add_argument("--tp", type=_positive, default=4, help="2d: size of the model axis (default 4)")
    p.add_argument("--spatial", type=_grid, default=(2, 2), metavar="HxW",
                   help="spatial: how H and W are split (default 2x2)")
    p.add_argument("--min-params", type=float, default=1e6,
                   help="fsdp-size: min_num_params of size_based_auto_wrap_policy (default 1e6)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--checkpoint", action="store_true",
                   help="activation checkpointing of every block (checkpoint_module)")
    p.add_argument("--extrapolate-layers", action="store_true",
                   help="GPT deeper than 2 layers: compile 1 and 2 layers and extrapolate linearly "
                        "(estimates; much faster for deep models)")
    p.add_argument("--run", action="store_true",
                   help="run the steps for real (small configurations) and measure them")
    p.add_argument("--out", default="memory-results", help="output folder (table, CSV, PNG)")
    p.add_argument("--name", default="memory", help="file name stem of the outputs")
    p.add_argument("--cache-dir", default=".xshard-cache", help="result cache folder")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    return p


def _provision_devices(needed: int, argv: list[str], may_reexec: bool) -> None:
    """Makes sure the runtime has ``needed`` devices (see the module docstring)."""
    platform = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if platform and platform != "CPU":
        from xshard.core import runtime

        have = runtime.device_count()
        if have < needed:
            raise UsageError(f"--devices {needed} needs {needed} devices; the {platform} runtime "
                             f"has {have}. Ask for at most {have}.")
        return
    raw = os.environ.get("XSHARD_CPU_DEVICES")
    if raw is not None:
        try:
            have = int(raw)
        except ValueError:
            raise UsageError(f"XSHARD_CPU_DEVICES={raw!r} is not a number of devices; unset it "
                             f"(the command sets it) or give a positive integer.") from None
        if have >= needed:
            return
        raise UsageError(f"--devices {needed} needs {needed} devices, but XSHARD_CPU_DEVICES={have} "
                         f"allows {have}. Unset XSHARD_CPU_DEVICES (the command then sets it) or "
                         f"raise it to {needed}.")
    if needed <= 1:
        return
    if not may_reexec:
        raise UsageError(f"--devices {needed} needs {needed} virtual CPU devices; set "
                         f"XSHARD_CPU_DEVICES={needed} before xshard is imported.")
    env = dict(os.environ, XSHARD_CPU_DEVICES=str(needed), PJRT_DEVICE="CPU")
    os.execve(sys.executable, [sys.executable, "-m", "xshard.experiments.memory", *argv], env)


def _fast_compile_flags() -> None:
    # Compile-only figures never run the code: skip LLVM's optimisation of the CPU kernels (about
    # 40% of compile time). Buffer assignment, and so every memory figure, is unchanged.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true").strip()


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit code (2 for bad input)."""
    may_reexec = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        return _main(args, argv, may_reexec)
    except UsageError as e:
        print(f"xshard-memory: error: {e}", file=sys.stderr)
        return 2


def _main(args, argv, may_reexec) -> int:
    for m in args.model:
        if m not in MODELS:
            raise UsageError(f"unknown model {m!r}; choose from {', '.join(MODELS)}.")
    for s in args.strategy:
        if s not in STRATEGIES:
            raise UsageError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}.")
    if args.search == "model" and args.budget is None:
        raise UsageError("--search model needs a --budget (e.g. --budget 32GiB).")
    if args.batch and args.batch_per_device:
        raise UsageError("give --batch or --batch-per-device, not both.")
    if not args.run:
        _fast_compile_flags()
    _provision_devices(max(args.devices), argv, may_reexec)
    args.min_params = int(args.min_params)

    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from xshard.core import runtime

    have = runtime.device_count()
    if max(args.devices) > have:
        raise UsageError(f"--devices {max(args.devices)} needs {max(args.devices)} devices; the "
                         f"runtime has {have}.")
    console = Console(width=None if sys.stdout.isatty() else 200)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = None if args.no_cache else Path(args.cache_dir) / "memory-results.json"
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn()]
    started = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        runner = Runner(cache, args.extrapolate_layers, progress,
                        log=lambda text: progress.console.print(text, style="dim"))
        if args.budget is None:
            rows, columns_, table = sweep(args, runner, progress)
            title = "per-device memory (GiB) of one training step"
            plot_sweep(out / f"{args.name}.png", rows, title)
        elif args.search == "batch":
            rows, columns_, table = batch_search(args, runner, progress)
            title = f"largest batch within {args.budget / GiB:g} GiB per device"
            plot_batch(out / f"{args.name}.png", rows, title)
        else:
            rows, columns_, table = model_search(args, runner, progress)
            title = f"largest model within {args.budget / GiB:g} GiB per device"
            plot_models(out / f"{args.name}.png", rows, title)
    print_table(console, title, columns_, table)
    write_csv(out / f"{args.name}.csv", rows)
    (out / f"{args.name}.txt").write_text(markdown_table(columns_, table))
    console.print(f"wrote {out / args.name}.csv, .png, .txt; {runner.computed} configurations "
                  f"computed, {runner.hits} from the cache, {time.perf_counter() - started:.0f} s")
    return 0
