"""Evaluating configurations through a cache, and the searches: sweeps, largest batch, largest model."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from xshard.experiments.memory.config import Config, UsageError, check_config, make_config
from xshard.experiments.memory.report import GiB, gib
from xshard.experiments.memory.step import LINEAR_FIGURES, analyse


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
        for k in LINEAR_FIGURES:
            out[k] = one[k] + (two[k] - one[k]) * (cfg.layers - 1)
        out["estimate"] = "extrapolated"
        out["params"] = cfg.num_params()
        out["compile_seconds"] = one["compile_seconds"] + two["compile_seconds"]
        return out




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



def configs_for(args, batches_for):
    configs, skipped = [], []
    for model in args.model:
        for strategy in args.strategy:
            for n in args.devices:
                for batch in batches_for(model, strategy, n):
                    cfg = make_config(args, model, strategy, n, batch)
                    why = check_config(cfg)
                    (skipped.append((cfg, why)) if why else configs.append(cfg))
    return configs, skipped


def sweep(args, runner, progress):
    def batches(model, strategy, n):
        if args.batch:
            return args.batch
        cfg = make_config(args, model, strategy, n, n)
        return [(args.batch_per_device or 1) * cfg.data_degree()]

    configs, skipped = configs_for(args, batches)
    report_skips(progress, skipped, configs)
    task = progress.add_task("configurations", total=len(configs))
    rows = sweep_rows(runner, configs, lambda: progress.advance(task))
    columns = ["model", "strategy", "devices", "batch", "params (M)", "params/dev", "grads/dev",
               "optimizer/dev", "inputs/dev", "temp/dev", "peak/dev", "TFLOP/dev", "estimate"]
    table = [(r["model"], r["strategy"], r["devices"], r["batch"], f"{r['params'] / 1e6:.1f}",
              gib(r["parameter_bytes"]), gib(r["gradient_bytes"]), gib(r["optimizer_bytes"]),
              gib(r["input_bytes"]), gib(r["temp_bytes"]), gib(r["peak_bytes"]),
              f"{r['flops'] / 1e12:.3f}", r["estimate"]) for r in rows]
    return rows, columns, table



def batch_search(args, runner, progress):
    def first(model, strategy, n):
        return [max(1, make_config(args, model, strategy, n, 1).data_degree())]

    configs, skipped = configs_for(args, first)
    report_skips(progress, skipped, configs)
    task = progress.add_task("batch searches", total=len(configs))
    rows, nothing = [], []
    for base in configs:
        step = (args.batch_per_device or 1) * base.data_degree()  # B per data-parallel replica
        count = args.max_batch // step
        if count < 1:
            raise UsageError(
                f"--max-batch {args.max_batch} is below the batch step of {base.label()}: {step} "
                f"(--batch-per-device {args.batch_per_device or 1} x its data-parallel degree "
                f"{base.data_degree()}). Raise --max-batch to at least {step}.")
        progress.update(task, description=f"searching {base.model}/{base.strategy}/N={base.devices}")

        def peak_of(k, base=base, step=step):
            return runner.evaluate(dataclasses.replace(base, batch=k * step))["peak_bytes"]

        k, probes = largest_fitting(peak_of, count, args.budget)
        best = None if k is None else k * step
        above = probes.get(k + 1) if k is not None else probes.get(1)
        at = runner.evaluate(dataclasses.replace(base, batch=best)) if best else None
        row = {**dataclasses.asdict(base), "batch": best, "max_batch": best, "budget": args.budget,
               # the search stopped at --max-batch: the largest batch that fits is at least this
               "at_limit": k == count,
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
    table = [(r["model"], r["strategy"], r["devices"], r["step"],
              f">= {r['max_batch']} (--max-batch)" if r["at_limit"] else r["max_batch"] or "none",
              gib(r["peak_at_max"]), gib(r["peak_above"]), len(json.loads(r["probes"])),
              r["estimate"]) for r in rows]
    return rows, columns, table


def model_search(args, runner, progress):
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
              f"{r['max_params'] / 1e9:.2f}" if r["max_params"] else "", gib(r["peak_at_max"]),
              gib(r["state_at_max"]), gib(r["temp_at_max"]), r["next_model"] or "",
              gib(r["peak_next"]), r["estimate"]) for r in rows]
    return rows, columns, table


def sweep_rows(runner: Runner, configs, advance) -> list[dict]:
    rows = []
    for cfg in configs:
        r = runner.evaluate(cfg)
        rows.append({**dataclasses.asdict(cfg), **r})
        advance()
    return rows


def report_skips(progress, skipped, configs):
    for cfg, why in skipped:
        progress.console.print(f"skipping {cfg.model}/{cfg.strategy}/N={cfg.devices}: {why}",
                               style="yellow")
    if not configs:
        raise UsageError("no configuration can be built: " + "; ".join(sorted({w for _, w in skipped})))
