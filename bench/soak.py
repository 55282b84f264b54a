"""Soak: 10 million items through prefetch, parallel map and bucketing, resources sampled.

The pipeline: 1,000 chunks of 10,000 ints (read by a `SelectManyIterator` from a shuffled
chunk list), a process `PrefetchIterator`, a 2-process `ParallelMapIterator` and a
`BucketedReadaheadBatchIterator`; the consumer takes a state every 10,000 batches, as a
training loop would. Every ``--interval`` seconds a thread samples the resident memory
(RSS), threads and open file descriptors of the consumer and of its worker processes
(all descendants), and the /dev/shm entries they have mapped. Linux only (/proc).

Writes ``bench/results/soak.csv`` and ``soak.json`` (samples and the slopes, fitted over
the second half of the run, after warm-up) and the plot ``docs/img/soak.png``; prints the
slopes. Flat lines mean that what a long run holds does not grow with the items it has
seen: no leak.

    python bench/soak.py                    # 10 million items: a few minutes on 2 cores
    python bench/soak.py --items 1000000    # a quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from _proc import descendants_of
from _util import REPO_ROOT, RESULTS_DIR, machine_info

from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    InfinitePermutationSourceIterator,
    ParallelMapIterator,
    PrefetchIterator,
    SelectManyIterator,
)

CHUNK = 10_000
PAGE = os.sysconf("SC_PAGE_SIZE")
METRICS = ("rss_mb", "threads", "fds", "shm")


def read_chunk(index: int) -> range:
    return range(index * CHUNK, (index + 1) * CHUNK)


def transform(item: int) -> tuple[int, int]:
    return item, item % 97


def length(item: tuple[int, int]) -> int:
    return item[1]


def build(start_method: str) -> Any:
    chunks = InfinitePermutationSourceIterator(list(range(1000)), seed=1)
    items = SelectManyIterator(chunks, read_chunk)
    prefetched = PrefetchIterator(items, 1000, start_method=start_method)
    mapped = ParallelMapIterator(prefetched, transform, 2, 500, start_method=start_method)
    return BucketedReadaheadBatchIterator(mapped, 2048, length, 64, seed=2)


def measure(pid: int) -> dict[str, float]:
    try:
        with open(f"/proc/{pid}/statm") as file:
            rss = int(file.read().split()[1]) * PAGE
        with open(f"/proc/{pid}/status") as file:
            threads = next(int(line.split()[1]) for line in file if line.startswith("Threads:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/maps") as file:
            shm = len({line.split()[-1] for line in file if "/dev/shm/" in line})
    except (OSError, StopIteration):
        return {}
    return {"rss_mb": rss / 2**20, "threads": threads, "fds": fds, "shm": shm}


class Sampler(threading.Thread):
    """Samples the consumer (this process) and its workers every `interval` seconds."""

    def __init__(self, interval: float) -> None:
        super().__init__(name="soak.sampler", daemon=True)
        self.interval, self.items, self.samples = interval, 0, []  # type: ignore[var-annotated]
        self.started = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        row: dict[str, float] = {"seconds": time.monotonic() - self.started, "items": self.items}
        consumer = measure(os.getpid())
        workers = [m for m in map(measure, descendants_of(os.getpid())) if m]
        for metric in METRICS:
            row[f"consumer_{metric}"] = consumer.get(metric, 0)
            row[f"workers_{metric}"] = sum(m[metric] for m in workers)
        row["workers"] = len(workers)
        self.samples.append(row)


def slope_per_million(samples: list[dict[str, float]], column: str) -> float:
    """Least-squares slope of `column` against items, per million items, second half."""
    half = samples[len(samples) // 2 :]
    xs = [s["items"] / 1e6 for s in half]
    ys = [s[column] for s in half]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        if spread
        else 0.0
    )


def plot(samples: list[dict[str, float]], slopes: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    millions = [s["items"] / 1e6 for s in samples]
    titles = {
        "rss_mb": "RSS (MiB)",
        "threads": "threads",
        "fds": "file descriptors",
        "shm": "/dev/shm entries mapped",
    }
    for axis, metric in zip(axes, METRICS, strict=True):
        for who, style in (("consumer", "-"), ("workers", "--")):
            column = f"{who}_{metric}"
            axis.plot(
                millions,
                [s[column] for s in samples],
                style,
                label=f"{who} ({slopes[column]:+.3g} per M items)",
            )
        axis.set_title(titles[metric])
        axis.set_xlabel("items consumed (millions)")
        axis.set_ylim(
            bottom=0,
            top=max(
                1.0,
                1.3
                * max(max(s[f"{w}_{metric}"] for s in samples) for w in ("consumer", "workers")),
            ),
        )
        axis.legend(fontsize=7, loc="lower right")
    figure.suptitle("Soak: prefetch (process) -> parallel map (2 processes) -> bucketing")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000_000)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--start-method", default="fork")
    parser.add_argument("--plot", type=Path, default=REPO_ROOT / "docs" / "img" / "soak.png")
    args = parser.parse_args()
    sampler = Sampler(args.interval)
    states = 0
    with build(args.start_method) as pipeline:
        sampler.start()
        for number, batch in enumerate(pipeline):
            sampler.items += len(batch)
            if number % 10_000 == 0:
                pipeline.getstate()
                states += 1
            if sampler.items >= args.items:
                break
        sampler.done.set()
        sampler.join()
    samples = sampler.samples
    columns = [f"{who}_{metric}" for metric in METRICS for who in ("consumer", "workers")]
    slopes = {column: slope_per_million(samples, column) for column in columns}
    RESULTS_DIR.mkdir(exist_ok=True)
    with open(RESULTS_DIR / "soak.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(samples[0]))
        writer.writeheader()
        writer.writerows(samples)
    seconds = samples[-1]["seconds"]
    (RESULTS_DIR / "soak.json").write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "arguments": {**vars(args), "plot": str(args.plot)},
                "items": sampler.items,
                "seconds": seconds,
                "states_taken": states,
                "slopes_per_million_items": slopes,
                "samples": samples,
            },
            indent=1,
        )
    )
    plot(samples, slopes, args.plot)
    print(
        f"{sampler.items:,} items in {seconds:.0f} s ({sampler.items / seconds:,.0f} items/s), "
        f"{len(samples)} samples"
    )
    for column in columns:
        first, last = samples[0][column], samples[-1][column]
        print(
            f"  {column:18} first {first:9.1f}  last {last:9.1f}  "
            f"slope (second half) {slopes[column]:+.4f} per million items"
        )


if __name__ == "__main__":
    main()
