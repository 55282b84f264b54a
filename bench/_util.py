"""Small helpers shared by the benchmark scripts (library loading, tables, result files)."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` puts only bench/ on sys.path
    sys.path.insert(1, str(REPO_ROOT))

LIBRARIES = ("infinibatch", "infinibatch_like")


@dataclass
class Library:
    """The infinibatch-compatible faces of one library."""

    name: str
    iterators: ModuleType
    datasets: ModuleType


def load_library(name: str) -> tuple[Library | None, str]:
    """Import ``<name>.iterators`` and ``<name>.datasets``; return (library, "") or (None, why)."""
    try:
        iterators = importlib.import_module(f"{name}.iterators")
        datasets = importlib.import_module(f"{name}.datasets")
    except Exception as exc:  # the library may be half-written while benchmarks are developed
        return None, f"{type(exc).__name__}: {exc}"
    return Library(name, iterators, datasets), ""


def load_libraries(only: Sequence[str] | None = None) -> dict[str, Library]:
    """Load every available library of ``LIBRARIES`` (or ``only``), warning about missing ones."""
    loaded: dict[str, Library] = {}
    for name in only or LIBRARIES:
        lib, why = load_library(name)
        if lib is None:
            print(
                f"[bench] {name} unavailable ({why}); it will be reported as n/a", file=sys.stderr
            )
        else:
            loaded[name] = lib
    return loaded


def library_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "versions": {n: library_version(n) for n in (*LIBRARIES, "torchdata", "torch")},
    }


class Stopwatch:
    """Measures wall-clock and process CPU time from its creation.

    CPU time (``time.process_time``) is the primary clock of these benchmarks: the workloads are
    single-threaded, and on a shared machine other processes inflate wall-clock time but not the
    CPU time of this process.  Wall-clock time is recorded alongside.
    """

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def read(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds) since creation."""
        return time.perf_counter() - self._wall, time.process_time() - self._cpu


@dataclass
class Samples:
    """Repeated (wall, CPU) measurements of one quantity, in seconds."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, sample: tuple[float, float]) -> None:
        self.wall.append(sample[0])
        self.cpu.append(sample[1])

    def summary(self, scale: float = 1.0) -> dict[str, Any]:
        return {
            "cpu_min": min(self.cpu) * scale,
            "cpu_median": median(self.cpu) * scale,
            "wall_min": min(self.wall) * scale,
            "wall_median": median(self.wall) * scale,
            "cpu_all": [x * scale for x in self.cpu],
            "wall_all": [x * scale for x in self.wall],
        }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: Any, spec: str = ".3g") -> str:
    """Format a number for a table; None becomes 'n/a'."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return format(value, spec)
    return str(value)


def points_label(n: int) -> str:
    """10000 -> '1e4', 1000000 -> '1e6', 1050000 -> '1.05e6', 12345 -> '12345'."""
    exponent = len(str(abs(n))) - 1
    if exponent < 3 or n % 10 ** (exponent - 2):
        return str(n)
    return f"{n / 10**exponent:g}e{exponent}"


def verdict(value: float | None, target: float, higher_is_better: bool) -> str:
    """'PASS' or 'MISS (by x%)' for a value against a target."""
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    if ok:
        return "PASS"
    off = (target / value - 1) if higher_is_better else (value / target - 1)
    return f"MISS (by {off:.0%})"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    line = "+".join("-" * (w + 2) for w in widths)
    print(f"\n{title}")
    print(line)
    for index, row in enumerate(cells):
        print(
            " "
            + " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            + " "
        )
        if index == 0:
            print(line)
    print(line)


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus machine info to ``bench/results/<name>.json``; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    print(f"\nresults written to {path.relative_to(REPO_ROOT)}")
    return path
