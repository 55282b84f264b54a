"""`History`: statistics recorded over a run, and a plot of the stages' time shares."""

from __future__ import annotations

import time
from typing import Any

from .._core.extras import missing_extra
from .._core.protocol import CheckpointableIterator
from ._collect import StageStats, collect


class History:
    """Statistics of `pipeline` recorded now and then over a run (call `record`, e.g.
    every 100 steps), for `shares` and `plot`."""

    def __init__(self, pipeline: CheckpointableIterator[Any]) -> None:
        self._pipeline = pipeline
        self.snapshots: list[tuple[float, list[StageStats]]] = []
        """(seconds since the first record, `collect` result) per `record` call."""
        self._start: float | None = None

    def record(self) -> None:
        """Take a `collect` snapshot now."""
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        self.snapshots.append((now - self._start, collect(self._pipeline)))

    def shares(self) -> tuple[list[float], dict[str, list[float]]]:
        """Each stage's share of the pipeline's work between consecutive records: the end
        times of the intervals, and per stage path the shares (0..1)."""
        times: list[float] = []
        shares: dict[str, list[float]] = {}
        for (_, before), (at, after) in zip(self.snapshots, self.snapshots[1:], strict=False):
            work = {
                entry["path"]: entry["work_s"] - old["work_s"]
                for entry, old in zip(after, before, strict=True)
            }
            total = sum(value for value in work.values() if value > 0)
            times.append(at)
            for path, value in work.items():
                shares.setdefault(path, []).append(max(0.0, value) / total if total else 0.0)
        return times, shares

    def plot(self, path: str | None = None, title: str = "Stage time shares") -> Any:
        """A stacked area chart of `shares` (needs matplotlib: ``pip install
        'infinibatch_like[plot]'``); saved to `path` if given. Returns the figure."""
        try:
            import matplotlib

            if path is not None:
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ModuleNotFoundError as error:
            raise missing_extra("matplotlib", "plot", "stats.History.plot") from error
        times, shares = self.shares()
        figure, axes = plt.subplots(figsize=(8, 4))
        labels = [_label(name) for name in shares]
        axes.stackplot(times, *[[100 * v for v in s] for s in shares.values()], labels=labels)
        axes.set_xlabel("seconds")
        axes.set_ylabel("share of the pipeline's work (%)")
        axes.set_ylim(0, 100)
        axes.set_title(title)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
        figure.tight_layout()
        if path is not None:
            figure.savefig(path, dpi=100)
        return figure


def _label(path: str) -> str:
    names = [part.split(".")[0] for part in path.split(" > ")]
    return f"{len(names) - 1}: {names[-1]}"
