"""Parquet rows per second: `read_parquet` row-group chunks against pyarrow's own loop.

The data set is Hub-style: ``data/train-0000k-of-0000n.parquet`` files of a ``text`` column
(about 600 bytes of words per row) plus ``id`` and ``lang``, in row groups of 10,000 rows,
cached under ``bench/.data/``. Every method reads the ``text`` and ``id`` columns of every
row:

- the reference, pyarrow's own iteration: ``ParquetFile(path).iter_batches(columns=...)``
  then ``batch.to_pylist()`` for each batch, file by file;
- ``read_parquet`` over the ``list_parquet_chunks`` chunks, directly (a loop over chunks);
- ``chunked_dataset_iterator(chunks, read_parquet, ...)`` in evaluation order (no shuffle):
  the pipeline, with its per-item stage;
- the same with shuffling (one pass: ``epochs=1``, a blockwise shuffle of 10,000 rows);
- record batches on both sides: ``iter_batches`` against ``read_parquet(batch_rows=...)``.

Methods alternate within each repetition; the table reports medians of CPU time (of every
thread of the process: pyarrow decodes in threads) and of wall time, rows (or batches) per
CPU second and ratios to the reference.

Run: ``python bench/bench_parquet.py [--rows N] [--files N] [--reps N]``.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from _util import Samples, Stopwatch, print_table, ratio, write_result
from corpus import DEFAULT_CACHE

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import TableChunk, list_parquet_chunks, read_parquet

COLUMNS = ["id", "text"]
GROUP_ROWS = 10_000
BATCH_ROWS = 1024
WORDS = [f"w{n:03d}" for n in range(500)]


def build(rows: int, files: int) -> list[str]:
    """The data set's files (built once, cached)."""
    directory = DEFAULT_CACHE / f"parquet-r{rows}-f{files}" / "data"
    paths = [directory / f"train-{k:05d}-of-{files:05d}.parquet" for k in range(files)]
    if all(path.exists() for path in paths):
        return [str(path) for path in paths]
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    per_file = rows // files
    for k, path in enumerate(paths):
        ids = range(k * per_file, (k + 1) * per_file)
        text = [" ".join(rng.choices(WORDS, k=150)) for _ in ids]
        lang = ["fr" if i % 5 == 0 else "en" for i in ids]
        table = pa.table({"id": list(ids), "text": text, "lang": lang})
        temporary = path.with_suffix(".tmp")
        pq.write_table(table, temporary, row_group_size=GROUP_ROWS)
        temporary.rename(path)
    return [str(path) for path in paths]


def pyarrow_rows(paths: list[str], _: list[TableChunk]) -> int:
    count = 0
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(columns=COLUMNS):
            count += len(batch.to_pylist())
    return count


def direct_rows(_: list[str], chunks: list[TableChunk]) -> int:
    reader = functools.partial(read_parquet, columns=COLUMNS)
    return sum(1 for chunk in chunks for _ in reader(chunk))


def pipeline_rows(_: list[str], chunks: list[TableChunk]) -> int:
    reader = functools.partial(read_parquet, columns=COLUMNS)
    rows = chunked_dataset_iterator(chunks, reader, 1, train=False, shuffle=False)
    return sum(1 for _ in rows)


def shuffled_rows(_: list[str], chunks: list[TableChunk]) -> int:
    reader = functools.partial(read_parquet, columns=COLUMNS)
    rows = chunked_dataset_iterator(chunks, reader, 10_000, seed=1, epochs=1)
    return sum(1 for _ in rows)


def pyarrow_batches(paths: list[str], _: list[TableChunk]) -> int:
    return sum(
        1
        for path in paths
        for _ in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=COLUMNS)
    )


def direct_batches(_: list[str], chunks: list[TableChunk]) -> int:
    reader = functools.partial(read_parquet, columns=COLUMNS, batch_rows=BATCH_ROWS)
    return sum(1 for chunk in chunks for _ in reader(chunk))


ROW_METHODS: dict[str, Callable[[list[str], list[TableChunk]], int]] = {
    "pyarrow iter_batches + to_pylist  [reference]": pyarrow_rows,
    "read_parquet per row group": direct_rows,
    "chunked_dataset_iterator, no shuffle": pipeline_rows,
    "chunked_dataset_iterator, shuffled (10k block)": shuffled_rows,
}
BATCH_METHODS: dict[str, Callable[[list[str], list[TableChunk]], int]] = {
    f"pyarrow iter_batches({BATCH_ROWS})  [reference]": pyarrow_batches,
    f"read_parquet(batch_rows={BATCH_ROWS})": direct_batches,
}


def measure(
    methods: dict[str, Callable[[list[str], list[TableChunk]], int]],
    paths: list[str],
    chunks: list[TableChunk],
    reps: int,
) -> tuple[dict[str, Samples], int]:
    counts = {name: method(paths, chunks) for name, method in methods.items()}  # warm-up
    assert len(set(counts.values())) == 1 or "batch" in next(iter(methods)), counts
    samples = {name: Samples() for name in methods}
    for _ in range(reps):
        for name, method in methods.items():
            watch = Stopwatch()
            method(paths, chunks)
            samples[name].add(watch.read())
    return samples, next(iter(counts.values()))


def report(title: str, samples: dict[str, Samples], items: int) -> dict[str, Any]:
    reference = next(iter(samples.values())).summary()["cpu_median"]
    rows: list[list[Any]] = []
    results = {}
    for name, sample in samples.items():
        summary = sample.summary()
        rate = items / summary["cpu_median"]
        speed = ratio(reference, summary["cpu_median"])
        rows.append([name, summary["cpu_median"] * 1e3, summary["wall_median"] * 1e3, rate, speed])
        results[name] = {**summary, "per_second": rate, "vs_reference": speed}
    print_table(title, ["method", "CPU ms", "wall ms", "per CPU second", "vs reference"], rows)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    paths = build(args.rows, args.files)
    chunks = list_parquet_chunks(paths)
    size = sum(Path(path).stat().st_size for path in paths)
    print(f"{len(paths)} files, {len(chunks)} row groups, {size / 1e6:.1f} MB")
    row_samples, rows = measure(ROW_METHODS, paths, chunks, args.reps)
    row_results = report(
        f"{rows:,} rows as dicts, median of {args.reps}", row_samples, rows
    )
    batch_samples, batches = measure(BATCH_METHODS, paths, chunks, args.reps)
    batch_results = report(
        f"record batches of {BATCH_ROWS} rows, median of {args.reps}", batch_samples, batches
    )
    write_result(
        "parquet",
        {
            "rows": rows,
            "files": len(paths),
            "row_groups": len(chunks),
            "rows_as_dicts": row_results,
            "record_batches": batch_results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
