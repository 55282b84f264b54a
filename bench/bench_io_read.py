"""Reading speed of `infinibatch_like.io.read_lines` against the standard library.

The reference is what an infinibatch user writes as ``read_chunk_fn``:
``gzip.open(path).read().splitlines()`` (bytes lines, not even decoded). `read_lines` gives
decoded str lines, streamed, with python-isal's igzip (or zlib-ng) when installed; the
target is at least 1.5x the reference's speed. The same corpus recompressed with zstd shows
``.zst`` chunks, and `read_lines` with the standard library's gzip shows what the fast
decompressor brings. Methods alternate within each repetition; the table reports medians of
CPU time and ratios to the reference.

Run: ``python bench/bench_io_read.py [--lines N] [--reps N]``.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _util import Samples, Stopwatch, print_table, ratio, verdict, write_result
from corpus import build_corpus

from infinibatch_like.io import _compression, open_output, read_lines

TARGET = 1.5


def zst_copy(chunks: list[str]) -> list[str]:
    """The corpus recompressed as .zst next to it (cached)."""
    out = []
    for chunk in chunks:
        target = Path(chunk).with_suffix(".zst")
        if not target.exists():
            with gzip.open(chunk) as source, open_output(target) as sink:
                sink.write(source.read())
        out.append(str(target))
    return out


def reference(path: str) -> int:
    return len(gzip.open(path).read().splitlines())


def library(path: str) -> int:
    return len(list(read_lines(path)))  # a list, as the reference makes


def library_stdlib_gzip(path: str) -> int:
    saved = _compression._gzip_module
    _compression._gzip_module = lambda: gzip  # type: ignore[assignment]
    try:
        return len(list(read_lines(path)))
    finally:
        _compression._gzip_module = saved  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    chunks = build_corpus(args.lines)
    zst_chunks = zst_copy(chunks)
    fast = _compression._gzip_module().__name__
    methods: dict[str, tuple[Callable[[str], int], list[str]]] = {
        "gzip.open(p).read().splitlines()  [reference]": (reference, chunks),
        f"read_lines(.gz)  [{fast}]": (library, chunks),
        "read_lines(.gz)  [stdlib gzip]": (library_stdlib_gzip, chunks),
        "read_lines(.zst)  [zstandard]": (library, zst_chunks),
    }
    samples = {name: Samples() for name in methods}
    counts: dict[str, int] = {}
    for name, (function, paths) in methods.items():  # warm-up: page cache, imports
        counts[name] = sum(function(p) for p in paths)
    assert len(set(counts.values())) == 1, counts
    for _ in range(args.reps):
        for name, (function, paths) in methods.items():
            watch = Stopwatch()
            for path in paths:
                function(path)
            samples[name].add(watch.read())
    ref = samples[next(iter(methods))].summary()["cpu_median"]
    rows: list[list[Any]] = []
    results = {}
    for name, sample in samples.items():
        summary = sample.summary()
        speedup = ratio(ref, summary["cpu_median"])
        rows.append([name, summary["cpu_median"] * 1e3, summary["wall_median"] * 1e3, speedup])
        results[name] = {**summary, "speedup": speedup}
    lines = next(iter(counts.values()))
    print_table(
        f"read {lines:,} lines in {len(chunks)} chunks, median of {args.reps} (CPU ms)",
        ["method", "CPU ms", "wall ms", "speed vs reference"],
        rows,
    )
    speedup = results[f"read_lines(.gz)  [{fast}]"]["speedup"]
    print(f"\nread_lines(.gz) vs reference: {speedup:.2f}x  target >= {TARGET}x: "
          f"{verdict(speedup, TARGET, higher_is_better=True)}")
    write_result("io_read", {"lines": lines, "chunks": len(chunks), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
