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
import csv
import dataclasses
import functools
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

STRATEGIES = ("dp", "fsdp-transformer", "fsdp-size", "2d", "spatial")
SCHEMA = 1  # bump when the meaning of a cached figure changes

# name: (layers, width, heads, vocab, seq)
GPT_PRESETS = {
    "gpt-tiny": (2, 64, 2, 256, 32),
    "gpt2-small": (12, 768, 12, 50257, 1024),
    "gpt2-medium": (24, 1024, 16, 50257, 1024),
    "gpt2-large": (36, 1280, 20, 50257, 1024),
    "gpt2-xl": (48, 1600, 25, 50257, 1024),
    "gpt-2.7b": (32, 2560, 32, 50304, 2048),
    "gpt-6.7b": (32, 4096, 32, 50304, 2048),
    "gpt-13b": (40, 5120, 40, 50304, 2048),
    "gpt-20b": (44, 6144, 48, 50304, 2048),
    "gpt-30b": (48, 7168, 56, 50304, 2048),
    "gpt-40b": (48, 8192, 64, 50304, 2048),
    "gpt-66b": (64, 9216, 72, 50304, 2048),
    "gpt-100b": (80, 10240, 80, 50304, 2048),
    "gpt-175b": (96, 12288, 96, 50304, 2048),
    "gpt-250b": (100, 14336, 112, 50304, 2048),
    "gpt-350b": (112, 16384, 128, 50304, 2048),
    "gpt-530b": (105, 20480, 128, 50304, 2048),
    "gpt-1t": (128, 25600, 160, 50304, 2048),
}
# name: (depths, widths, image size, classes)
RESNET_PRESETS = {
    "resnet-tiny": ((1, 1), (8, 16), 32, 10),
    "resnet50": ((3, 4, 6, 3), (64, 128, 256, 512), 224, 1000),
}
MODELS = ("gpt", *GPT_PRESETS, *RESNET_PRESETS)


class UsageError(Exception):
    """Bad input to the command: printed as one line, exit code 2."""


# -- configurations ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One training step to analyse. ``key()`` identifies it in the result cache."""

    model: str
    strategy: str
    devices: int
    batch: int
    layers: int = 0
    width: int = 0
    heads: int = 0
    vocab: int = 0
    seq: int = 0
    image: int = 0
    depths: tuple = ()
    widths: tuple = ()
    classes: int = 0
    tp: int = 1
    spatial: tuple = (1, 1)
    min_params: int = 0
    optimizer: str = "adamw"
    checkpoint: bool = False
    run: bool = False

    @property
    def kind(self) -> str:
        return "resnet" if self.image else "gpt"

    def key(self) -> str:
        return json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}, sort_keys=True)

    def num_params(self) -> int:
        if self.kind == "gpt":
            from xshard.models.gpt import GPTConfig

            return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers,
                             n_head=self.heads, n_embd=self.width).num_params()
        from xshard.models.resnet import ResNetConfig, num_params

        return num_params(ResNetConfig(depths=self.depths, widths=self.widths,
                                       num_classes=self.classes))

    def data_degree(self) -> int:
        """How many ways the batch is split (the batch must be a multiple of it)."""
        if self.strategy == "2d":
            return self.devices // self.tp
        if self.strategy == "spatial":
            return self.devices // (self.spatial[0] * self.spatial[1])
        return self.devices

    def label(self) -> str:
        return f"{self.model}/{self.strategy}/N={self.devices}/B={self.batch}"


def make_config(args, model: str, strategy: str, devices: int, batch: int) -> Config:
    common = dict(model=model, strategy=strategy, devices=devices, batch=batch,
                  optimizer=args.optimizer, checkpoint=args.checkpoint, run=args.run)
    if model in RESNET_PRESETS:
        depths, widths, image, classes = RESNET_PRESETS[model]
        spatial = args.spatial if strategy == "spatial" else (1, 1)
        return Config(**common, image=args.image or image, depths=depths, widths=widths,
                      classes=classes, spatial=spatial,
                      min_params=args.min_params if strategy == "fsdp-size" else 0)
    layers, width, heads, vocab, seq = GPT_PRESETS.get(model, GPT_PRESETS["gpt2-small"])
    return Config(**common, layers=args.layers or layers, width=args.width or width,
                  heads=args.heads or heads, vocab=args.vocab or vocab, seq=args.seq or seq,
                  tp=min(args.tp, devices) if strategy == "2d" else 1,
                  min_params=args.min_params if strategy == "fsdp-size" else 0)


def check_config(cfg: Config) -> str | None:
    """Why ``cfg`` cannot be built (a skip reason), or None."""
    if cfg.strategy == "2d" and cfg.kind != "gpt":
        return "2d (Megatron-style specs) applies to GPT models"
    if cfg.strategy == "spatial" and cfg.kind != "resnet":
        return "spatial partitioning applies to conv nets (resnet models)"
    if cfg.strategy == "2d" and cfg.devices % cfg.tp:
        return f"--tp {cfg.tp} does not divide {cfg.devices} devices"
    if cfg.strategy == "spatial" and cfg.devices % (cfg.spatial[0] * cfg.spatial[1]):
        return f"--spatial {cfg.spatial[0]}x{cfg.spatial[1]} does not divide {cfg.devices} devices"
    if cfg.kind == "gpt" and cfg.width % cfg.heads:
        return f"width {cfg.width} is not divisible by heads {cfg.heads}"
    if cfg.batch % cfg.data_degree():
        return f"batch {cfg.batch} is not a multiple of the data-parallel degree {cfg.data_degree()}"
    return None


# -- building and analysing one step ---------------------------------------------------------------


def _mesh(cfg: Config):
    from xshard.mesh import Mesh

    n = cfg.devices
    ids = list(range(n))
    if cfg.strategy == "dp":
        return Mesh(ids, (n,), ("data",))
    if cfg.strategy.startswith("fsdp"):
        return Mesh(ids, (n,), ("fsdp",))
    if cfg.strategy == "2d":
        return Mesh(ids, (n // cfg.tp, cfg.tp), ("data", "model"))
    h, w = cfg.spatial
    return Mesh(ids, (n // (h * w), h, w), ("data", "h", "w"))


def _megatron_spec(name: str, ndim: int) -> tuple:
    """Megatron-style layout of a GPT parameter on a (data, model) mesh."""
    if name == "wte.weight":
        return ("model", None)                      # vocab-parallel embedding (and tied head)
    if name.endswith(("attn.qkv.weight", "mlp.fc.weight")):
        return ("model", None)                      # column parallel
    if name.endswith(("attn.qkv.bias", "mlp.fc.bias")):
        return ("model",)
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return (None, "model")                      # row parallel
    return (None,) * ndim


def build(cfg: Config):
    """The model, optimizer, batch tensors and a step function for ``cfg`` (on the xshard device)."""
    import torch

    import xshard
    import xshard.spmd as xs
    from xshard.fsdp import FSDP, checkpoint_module, size_based_auto_wrap_policy
    from xshard.fsdp import transformer_auto_wrap_policy

    mesh = _mesh(cfg)
    dev = xshard.device()
    make = torch.device("cpu" if cfg.run else "meta")
    with make:
        if cfg.kind == "gpt":
            from xshard.models.gpt import GPT, Block, GPTConfig

            model = GPT(GPTConfig(vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=cfg.layers,
                                  n_head=cfg.heads, n_embd=cfg.width))
            unit_cls = Block
            units = model.blocks
        else:
            from xshard.models.resnet import Bottleneck, ResNet, ResNetConfig

            model = ResNet(ResNetConfig(depths=cfg.depths, widths=cfg.widths,
                                        num_classes=cfg.classes))
            unit_cls = Bottleneck
            units = model.blocks
    if cfg.checkpoint:
        for block in units:
            checkpoint_module(block)

    def data(shape, dtype, high):
        if cfg.run:
            t = (torch.randint(0, high, shape) if dtype == torch.long else torch.randn(shape))
        else:
            t = torch.empty(shape, dtype=dtype, device="meta")
        return t.to(dev)

    if cfg.kind == "gpt":
        x = data((cfg.batch, cfg.seq), torch.long, cfg.vocab)
        y = data((cfg.batch, cfg.seq), torch.long, cfg.vocab)
        in_specs = [("data" if cfg.strategy in ("dp", "2d") else "fsdp", None)] * 2
    else:
        x = data((cfg.batch, 3, cfg.image, cfg.image), torch.float32, 0)
        y = data((cfg.batch,), torch.long, cfg.classes)
        batch_axis = "fsdp" if cfg.strategy.startswith("fsdp") else "data"
        x_spec = ((batch_axis, None, "h", "w") if cfg.strategy == "spatial"
                  else (batch_axis, None, None, None))
        in_specs = [x_spec, (batch_axis,)]
    for t, spec in zip((x, y), in_specs):
        xs.mark_sharding(t, mesh, spec)

    if cfg.strategy.startswith("fsdp"):
        if cfg.strategy == "fsdp-transformer":
            policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={unit_cls})
        else:
            policy = functools.partial(size_based_auto_wrap_policy, min_num_params=cfg.min_params)
        model = FSDP(model, mesh=mesh, auto_wrap_policy=policy)
        for b in model.buffers():       # FSDP leaves buffers unannotated: pin them to the mesh
            xs.mark_sharding(b, mesh, (None,) * b.dim())
    else:
        model = model.to(dev)
        for name, p in model.named_parameters():
            spec = _megatron_spec(name, p.dim()) if cfg.strategy == "2d" else (None,) * p.dim()
            xs.mark_sharding(p, mesh, spec)
        for b in model.buffers():
            xs.mark_sharding(b, mesh, (None,) * b.dim())

    params = list(model.parameters())
    if cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=1e-2)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()

    return model, opt, [x, y], step


def analyse(cfg: Config) -> dict:
    """The figures of one configuration: compiled (compile-only) or measured (``cfg.run``)."""
    import xshard
    from xshard import memory

    start = time.perf_counter()
    try:
        if cfg.run:
            model, opt, inputs, step = build(cfg)
            step()
            xshard.sync(wait=True)
            step()
            m = memory.analyze_step(model.parameters(), opt, inputs)
            xshard.sync(wait=True)
            r = memory.measure_step(step, n=2, warmup=1)
            out = m.as_dict()
            out.update(estimate="measured", step_seconds=r.seconds,
                       live_bytes=r.max_live_bytes)
        else:
            with xshard.compile_only():
                model, opt, inputs, step = build(cfg)
                step()
                memory.abstract_sync()       # the state a first step leaves: steady-state figures
                step()
                m = memory.analyze_step(model.parameters(), opt, inputs)
                out = m.as_dict()
                out.update(estimate="compiled")
    finally:
        model = opt = inputs = step = None  # noqa: F841  (drop every tensor of this config)
        gc.collect()
    out["params"] = cfg.num_params()
    out["wall_seconds"] = time.perf_counter() - start
    return out


_LINEAR = ("argument_bytes", "parameter_bytes", "optimizer_bytes", "input_bytes",
           "other_argument_bytes", "output_bytes", "gradient_bytes", "temp_bytes", "alias_bytes",
           "peak_bytes", "xla_peak_bytes", "flops", "state_bytes")


class Runner:
    """Evaluates configurations through the JSON cache; optionally extrapolates GPT depth."""

    def __init__(self, cache_path: Path | None, extrapolate: bool, progress=None, log=print):
        self.cache_path = cache_path
        self.extrapolate = extrapolate
        self.progress = progress
        self.log = log
        self.cache = {}
        self.computed = 0
        self.hits = 0
        if cache_path is not None and cache_path.exists():
            try:
                self.cache = json.loads(cache_path.read_text())
            except (OSError, ValueError):
                self.cache = {}

    def _save(self):
        if self.cache_path is None:
            return
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.cache, indent=1, sort_keys=True))
        os.replace(tmp, self.cache_path)

    def compiled(self, cfg: Config) -> dict:
        key = cfg.key()
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.log(f"  computing {cfg.label()}" + (f" L={cfg.layers}" if cfg.kind == "gpt" else ""))
        result = analyse(cfg)
        self.computed += 1
        self.cache[key] = result
        self._save()
        return result

    def evaluate(self, cfg: Config) -> dict:
        """Figures for ``cfg``; with extrapolation, a GPT deeper than 2 layers is fitted from its
        1- and 2-layer versions (every figure is linear in the depth; see the docs)."""
        if not (self.extrapolate and cfg.kind == "gpt" and cfg.layers > 2 and not cfg.run):
            return dict(self.compiled(cfg))
        one = self.compiled(dataclasses.replace(cfg, layers=1))
        two = self.compiled(dataclasses.replace(cfg, layers=2))
        out = dict(two)
        for k in _LINEAR:
            out[k] = one[k] + (two[k] - one[k]) * (cfg.layers - 1)
        out["estimate"] = "extrapolated"
        out["params"] = cfg.num_params()
        out["compile_seconds"] = one["compile_seconds"] + two["compile_seconds"]
        return out


# -- searches -----------------------------------------------------------------------------------------


def largest_fitting(peak_of, count: int, budget: int):
    """Largest k in 1..count with ``peak_of(k) <= budget``, assuming the peak grows with k.

    Binary search; its bracket is seeded by a straight-line fit of the first two probes (memory is
    close to affine in the batch), so a search usually costs 3-5 compiles.

    Returns:
        (k or None when even k=1 does not fit, {k: peak} of every probe).
    """
    probes = {}

    def fits(k):
        if k not in probes:
            probes[k] = peak_of(k)
        return probes[k] <= budget

    if not fits(1):
        return None, probes
    if count == 1:
        return 1, probes
    if fits(2):
        lo, hi = 2, None
        slope = probes[2] - probes[1]
        if slope > 0:
            guess = 1 + int((budget - probes[1]) // slope)
            guess = max(2, min(guess, count))
            if fits(guess):
                lo = guess
                if guess + 1 <= count and not fits(guess + 1):
                    return guess, probes
            else:
                hi = guess
        while hi is None:  # gallop up until something does not fit
            nxt = min(count, lo * 2)
            if nxt == lo:
                return lo, probes
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 1, 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


# -- output -------------------------------------------------------------------------------------------

GiB = 2**30


def _gib(x) -> str:
    from xshard.memory import format_bytes

    return "" if x is None or x == "" else format_bytes(x)


def sweep_rows(runner: Runner, configs, advance) -> list[dict]:
    rows = []
    for cfg in configs:
        r = runner.evaluate(cfg)
        rows.append({**dataclasses.asdict(cfg), **r})
        advance()
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()})


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(path: Path, rows: list[dict], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_devices = len({r["devices"] for r in rows}) > 1
    x_key = "devices" if by_devices else "batch"
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["strategy"]), []).append(r)
    for (model, strategy), rs in groups.items():
        rs = sorted(rs, key=lambda r: r[x_key])
        xs_ = [r[x_key] for r in rs]
        line, = ax.plot(xs_, [r["state_bytes"] / GiB for r in rs], marker="o",
                        label=f"{model} {strategy}: params+grads+optimizer")
        ax.plot(xs_, [r["peak_bytes"] / GiB for r in rs], marker="x", linestyle="--",
                color=line.get_color(), label=f"{model} {strategy}: peak")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices" if by_devices else "global batch")
    ax.set_ylabel("GiB per device")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_batch(path: Path, rows: list[dict], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [f"{r['model']}\n{r['strategy']}\nN={r['devices']}" for r in rows]
    values = [r["max_batch"] or 0 for r in rows]
    bars = ax.bar(range(len(rows)), values, color="tab:blue")
    for bar, v in zip(bars, values):
        ax.annotate(str(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("largest global batch that fits")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_models(path: Path, rows: list[dict], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        rs = sorted((r for r in rows if r["strategy"] == strategy and r["max_params"]),
                    key=lambda r: r["devices"])
        ax.plot([r["devices"] for r in rs], [r["max_params"] / 1e9 for r in rs], marker="o",
                label=strategy)
        for r in rs:
            ax.annotate(r["max_model"], (r["devices"], r["max_params"] / 1e9), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("parameters of the largest model that fits (billions)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(console, title, columns, rows) -> None:
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c not in ("model", "strategy", "estimate") else "left")
    for r in rows:
        table.add_row(*[str(v) for v in r])
    console.print(table)


# -- the command ------------------------------------------------------------------------------------


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
            rows, columns_, table = _sweep(args, runner, progress)
            title = "per-device memory (GiB) of one training step"
            plot_sweep(out / f"{args.name}.png", rows, title)
        elif args.search == "batch":
            rows, columns_, table = _batch_search(args, runner, progress)
            title = f"largest batch within {args.budget / GiB:g} GiB per device"
            plot_batch(out / f"{args.name}.png", rows, title)
        else:
            rows, columns_, table = _model_search(args, runner, progress)
            title = f"largest model within {args.budget / GiB:g} GiB per device"
            plot_models(out / f"{args.name}.png", rows, title)
    print_table(console, title, columns_, table)
    write_csv(out / f"{args.name}.csv", rows)
    (out / f"{args.name}.txt").write_text(_plain_table(columns_, table))
    console.print(f"wrote {out / args.name}.csv, .png, .txt; {runner.computed} configurations "
                  f"computed, {runner.hits} from the cache, {time.perf_counter() - started:.0f} s")
    return 0


def _plain_table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _configs(args, batches_for):
    configs, skipped = [], []
    for model in args.model:
        for strategy in args.strategy:
            for n in args.devices:
                for batch in batches_for(model, strategy, n):
                    cfg = make_config(args, model, strategy, n, batch)
                    why = check_config(cfg)
                    (skipped.append((cfg, why)) if why else configs.append(cfg))
    return configs, skipped


def _sweep(args, runner, progress):
    def batches(model, strategy, n):
        if args.batch:
            return args.batch
        cfg = make_config(args, model, strategy, n, n)
        return [(args.batch_per_device or 1) * cfg.data_degree()]

    configs, skipped = _configs(args, batches)
    _report_skips(progress, skipped, configs)
    task = progress.add_task("configurations", total=len(configs))
    rows = sweep_rows(runner, configs, lambda: progress.advance(task))
    columns = ["model", "strategy", "devices", "batch", "params (M)", "params/dev", "grads/dev",
               "optimizer/dev", "inputs/dev", "temp/dev", "peak/dev", "TFLOP/dev", "estimate"]
    table = [(r["model"], r["strategy"], r["devices"], r["batch"], f"{r['params'] / 1e6:.1f}",
              _gib(r["parameter_bytes"]), _gib(r["gradient_bytes"]), _gib(r["optimizer_bytes"]),
              _gib(r["input_bytes"]), _gib(r["temp_bytes"]), _gib(r["peak_bytes"]),
              f"{r['flops'] / 1e12:.3f}", r["estimate"]) for r in rows]
    return rows, columns, table


def _report_skips(progress, skipped, configs):
    for cfg, why in skipped:
        progress.console.print(f"skipping {cfg.model}/{cfg.strategy}/N={cfg.devices}: {why}",
                               style="yellow")
    if not configs:
        raise UsageError("no configuration can be built: " + "; ".join(sorted({w for _, w in skipped})))


def _batch_search(args, runner, progress):
    def first(model, strategy, n):
        return [max(1, make_config(args, model, strategy, n, 1).data_degree())]

    configs, skipped = _configs(args, first)
    _report_skips(progress, skipped, configs)
    task = progress.add_task("batch searches", total=len(configs))
    rows, nothing = [], []
    for base in configs:
        step = args.batch_per_device or base.data_degree()
        step = math.lcm(step, base.data_degree())
        progress.update(task, description=f"searching {base.model}/{base.strategy}/N={base.devices}")

        def peak_of(k, base=base, step=step):
            return runner.evaluate(dataclasses.replace(base, batch=k * step))["peak_bytes"]

        k, probes = largest_fitting(peak_of, max(1, args.max_batch // step), args.budget)
        best = None if k is None else k * step
        above = probes.get(k + 1) if k is not None else probes.get(1)
        at = runner.evaluate(dataclasses.replace(base, batch=best)) if best else None
        row = {**dataclasses.asdict(base), "batch": best, "max_batch": best, "budget": args.budget,
               "step": step, "peak_at_max": at["peak_bytes"] if at else None,
               "peak_above": above, "probes": json.dumps({k_ * step: v for k_, v in
                                                           sorted(probes.items())}),
               "estimate": at["estimate"] if at else "compiled"}
        if at:
            row.update({k_: at[k_] for k_ in ("parameter_bytes", "optimizer_bytes",
                                             "gradient_bytes", "temp_bytes", "params")})
        rows.append(row)
        if best is None:
            nothing.append(base)
        progress.advance(task)
    if len(nothing) == len(rows):
        smallest = min(peak for r in rows for peak in [r["peak_above"]] if peak is not None)
        raise UsageError(f"nothing fits in {args.budget / GiB:g} GiB per device: the smallest "
                         f"batch needs at least {smallest / GiB:.3f} GiB. Raise --budget or use "
                         f"more devices.")
    columns = ["model", "strategy", "devices", "batch step", "max batch", "peak at max",
               "peak at max+step", "probes", "estimate"]
    table = [(r["model"], r["strategy"], r["devices"], r["step"], r["max_batch"] or "none",
              _gib(r["peak_at_max"]), _gib(r["peak_above"]), len(json.loads(r["probes"])),
              r["estimate"]) for r in rows]
    return rows, columns, table


def _model_search(args, runner, progress):
    per_device = args.batch_per_device or 1
    models = sorted(args.model, key=lambda m: make_config(args, m, "dp", 1, 1).num_params())
    task = progress.add_task("model searches", total=len(args.strategy) * len(args.devices))
    rows = []
    for strategy in args.strategy:
        for n in args.devices:
            cfgs = []
            for m in models:
                cfg = make_config(args, m, strategy, n, 1)
                cfg = dataclasses.replace(cfg, batch=per_device * cfg.data_degree())
                if check_config(cfg) is None:
                    cfgs.append(cfg)
            progress.update(task, description=f"searching {strategy}/N={n}")
            if not cfgs:
                progress.advance(task)
                continue

            def peak_of(k, cfgs=cfgs):
                return runner.evaluate(cfgs[k - 1])["peak_bytes"]

            k, probes = largest_fitting(peak_of, len(cfgs), args.budget)
            best = cfgs[k - 1] if k else None
            at = runner.evaluate(best) if best else None
            nxt = cfgs[k] if k is not None and k < len(cfgs) else None
            rows.append({"strategy": strategy, "devices": n, "batch": best.batch if best else None,
                         "max_model": best.model if best else None,
                         "max_params": best.num_params() if best else None,
                         "peak_at_max": at["peak_bytes"] if at else None,
                         "state_at_max": at["state_bytes"] if at else None,
                         "temp_at_max": at["temp_bytes"] if at else None,
                         "next_model": nxt.model if nxt else None,
                         "peak_next": probes.get(k + 1) if k else probes.get(1),
                         "estimate": at["estimate"] if at else "compiled",
                         "budget": args.budget})
            progress.advance(task)
    if not rows or all(r["max_model"] is None for r in rows):
        raise UsageError(f"no model among {', '.join(models)} fits in {args.budget / GiB:g} GiB "
                         f"per device; raise --budget, use more devices or add smaller models.")
    columns = ["strategy", "devices", "batch", "largest model", "params (B)", "peak",
               "params+grads+opt", "temp", "next model", "its peak", "estimate"]
    table = [(r["strategy"], r["devices"], r["batch"], r["max_model"] or "none",
              f"{r['max_params'] / 1e9:.2f}" if r["max_params"] else "", _gib(r["peak_at_max"]),
              _gib(r["state_at_max"]), _gib(r["temp_at_max"]), r["next_model"] or "",
              _gib(r["peak_next"]), r["estimate"]) for r in rows]
    return rows, columns, table


if __name__ == "__main__":
    sys.exit(main())
