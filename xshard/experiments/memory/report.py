"""Output of the memory study: tables (rich and Markdown), CSV and plots."""

from __future__ import annotations

import csv
from pathlib import Path



GiB = 2**30


def gib(x) -> str:
    from xshard.memory import format_bytes

    return "" if x is None or x == "" else format_bytes(x)


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
    for bar, v, r in zip(bars, values, rows):
        ax.annotate(f">={v}" if r["at_limit"] else str(v),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
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



def markdown_table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
