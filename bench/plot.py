"""Charts of the latest benchmark results (needs matplotlib: ``pip install matplotlib``).

Reads the JSON results in ``bench/results/`` (whichever exist) and draws:

- ``pipeline.png`` from ``bench_pipeline.json`` (and ``bench_pipeline_in_memory.json``):
  throughput, time to first batch, restore cost and state size, infinibatch_like against
  infinibatch 0.1.1;
- ``map_chain.png`` from ``bench_map_chain.json``: per-item cost of a chain of map stages
  against the generator floor, builtin ``map``, infinibatch and torchdata.nodes;
- ``background.png`` from ``background.json``: speed-ups from prefetching and parallel map.

Usage: ``python bench/plot.py`` after running the benchmarks writes the charts next to the
results; ``python bench/plot.py --out docs/img`` writes them for the documentation site.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {
    "infinibatch": "#9e9e9e",
    "infinibatch_like": "#1f77b4",
    "generator floor": "#c7dcef",
    "builtin map": "#c7dcef",
    "torchdata.nodes": "#e6a57e",
}
OTHER = "#c5c5c5"


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.exists():
        print(f"skipping {name}: {path} not found (run the benchmark first)")
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def footnote(fig: Any, data: dict[str, Any], clock: str) -> None:
    machine = data["machine"]
    if data.get("quick") or data.get("config", {}).get("quick"):
        clock += "; a --quick run (noisier)"
    fig.text(
        0.99,
        0.01,
        f"{machine['date'][:10]}, {machine['cpu_count']} cores, "
        f"{machine['implementation']} {machine['python']}; {clock}",
        ha="right",
        va="bottom",
        fontsize="x-small",
        color="#666666",
    )


def bars(ax: Any, labels: list[str], values: list[float], fmt: str, **kwargs: Any) -> None:
    drawn = ax.bar(labels, values, color=[COLORS.get(n, OTHER) for n in labels], **kwargs)
    ax.bar_label(drawn, fmt=fmt, fontsize="small")
    ax.set_ylim(0, max(values) * 1.18)


def grouped(
    ax: Any, groups: list[str], series: dict[str, list[float]], fmt: str, log: bool = False
) -> None:
    """One group of bars per entry of `groups`, one bar per series (library) in each."""
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        xs = [g + (index - (len(series) - 1) / 2) * width for g in range(len(groups))]
        drawn = ax.bar(xs, values, width=width, color=COLORS.get(name, OTHER), label=name)
        ax.bar_label(drawn, fmt=fmt, fontsize="x-small", padding=1)
    ax.set_xticks(range(len(groups)), groups)
    top = max(max(values) for values in series.values())
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(min(values) for values in series.values()) / 3, top * 6)
    else:
        ax.set_ylim(0, top * 1.2)


def plot_pipeline(plt: Any, data: dict[str, Any], memory: dict[str, Any] | None, out: Path) -> Path:
    results = data["results"]
    names = list(results)
    runs = {"gzip files": results}
    if memory is not None:
        runs["chunks in memory"] = memory["results"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.4))
    (throughput, first), (restore, size) = axes

    grouped(
        throughput,
        list(runs),
        {
            n: [run[n]["throughput_lines_per_s"]["cpu_best"] / 1e3 for run in runs.values()]
            for n in names
        },
        "%.0fk",
    )
    throughput.set_title("throughput, 1000 lines/s (higher is better)")
    throughput.legend(fontsize="small", loc="upper left")

    grouped(
        first,
        list(runs),
        {n: [run[n]["first_batch_ms"]["cpu_median"] for run in runs.values()] for n in names},
        "%.0f ms",
    )
    first.set_title("time to first batch, ms (lower is better)")

    points = [f"{c['target_lines']:,}" for c in results[names[0]]["checkpoints"]]
    grouped(
        restore,
        points,
        {n: [c["restore_ms"]["cpu_median"] for c in results[n]["checkpoints"]] for n in names},
        "%.0f",
    )
    restore.set_title("restore + first batch, ms (lower is better)")
    restore.set_xlabel("lines consumed before the checkpoint")

    grouped(
        size,
        points,
        {n: [c["pickle_bytes"] for c in results[n]["checkpoints"]] for n in names},
        "%d",
        log=True,
    )
    size.set_title("checkpoint size, pickled bytes (log scale)")
    size.set_xlabel("lines consumed before the checkpoint")

    cfg = data["config"]
    fig.suptitle(
        f"Pipeline: {cfg['chunks']} gzip chunks → block shuffle ({cfg['buffer_size']:,}) → "
        f"str.split → bucketed batches ({cfg['read_ahead']:,} read-ahead)",
        fontsize="medium",
    )
    footnote(fig, data, "CPU time, best of 5 / medians")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return save(plt, fig, out / "pipeline.png")


def plot_map_chain(plt: Any, data: dict[str, Any], out: Path) -> Path:
    results = data["results"]
    names = list(results)
    values = [results[n]["ns_per_item_per_stage"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.6))
    drawn = ax.barh(names, values, color=[COLORS.get(n, OTHER) for n in names])
    ax.bar_label(drawn, fmt="%.0f ns", padding=3, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("ns per item per stage (CPU time, lower is better)")
    cfg = data["config"]
    ax.set_title(f"{cfg['stages']} chained map stages over {cfg['items']:,} ints")
    ax.set_xlim(0, max(values) * 1.2)
    footnote(fig, data, "CPU time, best of 7")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(plt, fig, out / "map_chain.png")


def plot_background(plt: Any, data: dict[str, Any], out: Path) -> Path:
    speedups: list[tuple[str, float]] = []
    pipeline = data.get("a_pipeline")
    if pipeline is not None:
        for config, result in pipeline.get("configs", {}).items():
            speedups.append((f"pipeline, {config},\nvs infinibatch 0.1.1", result["speedup"]))
    for key, label in (
        ("b_parallel_map", "ParallelMapIterator (2 processes)\nvs MapIterator, 1 ms/item"),
        ("c_prefetch_process", "PrefetchIterator (process) vs none,\n1 ms producer + consumer"),
        ("c_prefetch_thread_io", "PrefetchIterator (thread) vs none,\nI/O-bound producer"),
    ):
        if key in data:
            speedups.append((label, data[key]["speedup"]))
    costs: list[tuple[str, float]] = []
    if "d_restore_latency" in data:
        costs.append(("restore + first batch,\nwith / without", data["d_restore_latency"]["ratio"]))
    for stage in ("prefetch", "parallel_map"):
        result = data.get(f"e_snapshot_cost_{stage}")
        if result is not None:
            label = f"{stage.replace('_', ' ')}: time with\nsnapshots / without"
            costs.append((label, 1 / result["throughput_ratio"]))
    panels = [(rows, kind) for rows, kind in ((speedups, "speed-up"), (costs, "cost")) if rows]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(11, 0.55 * max(len(r) for r, _ in panels) + 1.8), squeeze=False
    )
    most = max(len(rows) for rows, _ in panels)
    for ax, (rows, kind) in zip(axes[0], panels, strict=True):
        drawn = ax.barh(
            [r[0] for r in rows],
            [r[1] for r in rows],
            height=0.7,
            color=COLORS["infinibatch_like"] if kind == "speed-up" else OTHER,
        )
        ax.bar_label(drawn, fmt="%.2fx", padding=3, fontsize="small")
        ax.axvline(1.0, color="#666666", linewidth=0.8, linestyle="--")
        ax.set_ylim(most - 0.5, -0.5)  # top to bottom, bars equally thick in both panels
        ax.set_xlim(0, max(max(r[1] for r in rows) * 1.25, 1.3))
        ax.tick_params(axis="y", labelsize="small")
        if kind == "speed-up":
            ax.set_title("speed-ups (higher is better)")
            ax.set_xlabel("time without / time with, wall clock")
        else:
            ax.set_title("overheads (1.0 = none; lower is better)")
            ax.set_xlabel("time with / time without, wall clock")
    fig.suptitle("Background execution: prefetching and parallel map", fontsize="medium")
    footnote(fig, data, f"wall clock, median of {data['reps']}")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(plt, fig, out / "background.png")


def save(plt: Any, fig: Any, path: Path) -> Path:
    # No timestamps in the PNG's metadata, so an unchanged chart is an unchanged file.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSON results' folder")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: --results)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.rcParams.update({"font.size": 11})  # legible at the docs' column width
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib", file=sys.stderr)
        return 1
    out: Path = args.out or args.results
    out.mkdir(parents=True, exist_ok=True)
    written = []
    pipeline = load(args.results, "bench_pipeline")
    if pipeline is not None:
        memory = load(args.results, "bench_pipeline_in_memory")
        written.append(plot_pipeline(plt, pipeline, memory, out))
    chain = load(args.results, "bench_map_chain")
    if chain is not None:
        written.append(plot_map_chain(plt, chain, out))
    background = load(args.results, "background")
    if background is not None:
        written.append(plot_background(plt, background, out))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
