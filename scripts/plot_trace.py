"""Draws the timeline of an xshard profiler trace as a picture (PNG or SVG), with matplotlib.

Reads ``<run>/<host>.trace.json.gz`` (``xshard.profiler.stop_trace()`` returns ``<run>``) and draws,
top to bottom:

- the steps (``StepTrace`` spans, labelled with their step number);
- the user's own spans (``Trace``), e.g. forward / backward / optimizer;
- xshard's host work: recording ops, syncs, and inside a sync graph building, compiling (a cache
  miss) and dispatching the named executable; transfers between host and devices;
- the devices: each XLA CPU client thread's execution of a program (``ThunkExecutor::Execute``;
  on GPU/TPU the device lines of the trace hold the kernels instead).

With ``--steps A B`` a second panel zooms on steps A..B (e.g. the steady state after compiling).

Usage:
    python examples/train_gpt_fsdp.py --steps 4 --profile /tmp/gpt-profile
    python scripts/plot_trace.py /tmp/gpt-profile/plugins/profile/<run> --steps 2 3 \\
        --out docs/profile_train_gpt_fsdp.png
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys

XSHARD_ROWS = {  # span name -> (row below the user's spans, colour, label)
    "xshard.record": (0, "#9ecae1", "recording ops"),
    "xshard.sync": (0, "#fdd0a2", "sync"),
    "xshard.transfer_to_device": (0, "#a1d99b", "to device"),
    "xshard.transfer_from_device": (0, "#31a354", "from device"),
    "xshard.build_graph": (1, "#fd8d3c", "build graph"),
    "xshard.compile": (1, "#d62728", "compile"),
    "xshard.execute": (1, "#756bb1", "dispatch"),
}
STEP_COLOUR, USER_COLOUR, DEVICE_COLOUR = "#bdbdbd", "#fee391", "#6baed6"


def load(run_dir: str):
    """(thread names by tid, complete events) of the run's trace JSON."""
    paths = glob.glob(os.path.join(run_dir, "*.trace.json.gz"))
    if len(paths) != 1:
        raise SystemExit(f"expected one *.trace.json.gz in {run_dir}, found {len(paths)}: pass the "
                         f"run directory xshard.profiler.stop_trace() returned.")
    with gzip.open(paths[0], "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return threads, [e for e in events if e.get("ph") == "X"]


def classify(threads, events):
    """Splits the events into steps, user spans, xshard spans and device executions."""
    program_threads = {tid for tid, name in threads.items()
                       if name == "python" or name.startswith("pt_autograd")}
    ours = [e for e in events if e["tid"] in program_threads]
    steps = [e for e in ours if "step_num" in e.get("args", {})]
    xshard = [e for e in ours if e["name"] in XSHARD_ROWS]
    inside_xshard = [(e["ts"], e["ts"] + e["dur"]) for e in xshard if e["name"] != "xshard.record"]

    def is_user(e):
        if e in steps or e["name"] in XSHARD_ROWS or e["name"].startswith("$"):
            return False
        if any(c in e["name"] for c in "():[ ") or e["name"][:1].isupper():
            return False  # jax's and XLA's own events (PjitFunction(...), DevicePut, ...)
        return not any(s <= e["ts"] and e["ts"] + e["dur"] <= t for s, t in inside_xshard)

    user = [e for e in ours if is_user(e)]
    device_threads = sorted(tid for tid, name in threads.items()
                            if name.startswith("tf_XLAPjRtCpuClient"))
    devices = {tid: [e for e in events
                     if e["tid"] == tid and e["name"].startswith("ThunkExecutor::Execute")]
               for tid in device_threads}
    devices = {tid: evs for tid, evs in devices.items() if evs}
    return steps, user, xshard, devices


def draw(ax, steps, user, xshard, devices, t0, t1, title):
    """One panel: the events overlapping [t0, t1] (µs), drawn in ms from t0."""
    def visible(e):
        return e["ts"] < t1 and e["ts"] + e["dur"] > t0

    def bar(row, e, colour, label=None):
        start, width = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
        ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="black",
                       linewidth=0.3)
        span = (t1 - t0) / 1e3
        if label and width > span * 0.04:
            ax.text(start + width / 2, row, label, ha="center", va="center", fontsize=7,
                    clip_on=True)

    rows = []
    rows.append("steps")
    for e in filter(visible, steps):
        bar(len(rows) - 1, e, STEP_COLOUR, f"{e['name']} {e['args']['step_num']}")
    rows.append("your spans")
    for e in filter(visible, user):
        bar(len(rows) - 1, e, USER_COLOUR, e["name"])
    base = len(rows)
    rows += ["xshard", "xshard (in sync)"]
    for e in filter(visible, xshard):
        row, colour, label = XSHARD_ROWS[e["name"]]
        bar(base + row, e, colour, label)
    for i, (tid, evs) in enumerate(sorted(devices.items())):
        rows.append(f"XLA CPU thread {i}")
        for e in filter(visible, evs):
            bar(len(rows) - 1, e, DEVICE_COLOUR)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", linewidth=0.3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run directory (xshard.profiler.stop_trace() returns it)")
    p.add_argument("--out", required=True, help="the picture to write (.png or .svg)")
    p.add_argument("--steps", type=int, nargs=2, metavar=("A", "B"),
                   help="also draw steps A..B (step numbers) in a zoomed panel")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    threads, events = load(args.run_dir)
    steps, user, xshard, devices = classify(threads, events)
    if not steps and not xshard:
        raise SystemExit("no StepTrace or xshard spans in this trace: was it taken with "
                         "xshard.profiler.start_trace()?")
    spans = steps or xshard
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    panels = [(t0, t1, "whole trace")]
    if args.steps:
        a, b = args.steps
        chosen = [e for e in steps if a <= int(e["args"]["step_num"]) <= b]
        if not chosen:
            raise SystemExit(f"no steps numbered {a}..{b} in this trace; it has "
                             f"{sorted(int(e['args']['step_num']) for e in steps)}.")
        panels.append((min(e["ts"] for e in chosen), max(e["ts"] + e["dur"] for e in chosen),
                       f"steps {a}..{b}"))
    n_rows = 4 + len(devices)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, (0.32 * n_rows + 0.9) * len(panels)),
                             squeeze=False)
    for ax, (start, end, title) in zip(axes[:, 0], panels):
        draw(ax, steps, user, xshard, devices, start, end, title)
    legend = [mpatches.Patch(color=c, label=label) for _, c, label in XSHARD_ROWS.values()]
    legend += [mpatches.Patch(color=DEVICE_COLOUR, label="XLA executing (per thread)")]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
