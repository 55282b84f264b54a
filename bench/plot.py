"""Charts of the latest benchmark results (needs matplotlib: ``pip install matplotlib``).

Reads ``bench/results/bench_map_chain.json`` and ``bench/results/bench_pipeline.json`` (whichever
exist) and writes ``map_chain.png`` and ``pipeline.png`` next to them.

Usage: ``python bench/plot.py`` after running the benchmarks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {"infinibatch": "#9e9e9e", "infinibatch_like": "#1f77b4"}


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        print(f"skipping {name}: {path} not found (run bench/{name}.py first)")
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def plot_map_chain(plt: Any, data: dict[str, Any]) -> Path:
    results = data["results"]
    names = list(results)
    values = [results[n]["ns_per_item_per_stage"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(names) + 1.4))
    bars = ax.barh(names, values, color=[COLORS.get(n, "#c5c5c5") for n in names])
    ax.bar_label(bars, fmt="%.0f ns", padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("ns per item per stage (CPU time, lower is better)")
    cfg = data["config"]
    ax.set_title(f"{cfg['stages']} chained map stages over {cfg['items']:,} ints")
    ax.set_xlim(0, max(values) * 1.2)
    fig.tight_layout()
    out = RESULTS / "map_chain.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_pipeline(plt: Any, data: dict[str, Any]) -> Path:
    results = data["results"]
    names = list(results)
    colors = [COLORS.get(n, "#c5c5c5") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    rates = [results[n]["throughput_lines_per_s"]["cpu_best"] / 1e3 for n in names]
    bars = axes[0].bar(names, rates, color=colors)
    axes[0].bar_label(bars, fmt="%.0fk")
    axes[0].set_title("throughput, 1000 lines/s (higher is better)")
    axes[0].set_ylim(0, max(rates) * 1.15)
    first = [results[n]["first_batch_ms"]["cpu_median"] for n in names]
    bars = axes[1].bar(names, first, color=colors)
    axes[1].bar_label(bars, fmt="%.0f ms")
    axes[1].set_title("time to first batch (lower is better)")
    axes[1].set_ylim(0, max(first) * 1.15)
    points = [c["target_lines"] for c in results[names[0]]["checkpoints"]]
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ms = [c["restore_ms"]["cpu_median"] for c in results[n]["checkpoints"]]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(points))]
        axes[2].bar(xs, ms, width=width, color=COLORS.get(n, "#c5c5c5"), label=n)
    axes[2].set_xticks(range(len(points)), [f"{p:,}" for p in points])
    axes[2].set_xlabel("lines consumed before the checkpoint")
    axes[2].set_title("restore + first batch, ms (lower is better)")
    axes[2].legend(fontsize="small")
    for ax in axes:
        ax.tick_params(axis="x", labelsize="small")
    fig.tight_layout()
    out = RESULTS / "pipeline.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 1
    for name, plotter in (("bench_map_chain", plot_map_chain), ("bench_pipeline", plot_pipeline)):
        data = load(name)
        if data is not None:
            print(f"wrote {plotter(plt, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
