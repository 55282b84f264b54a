"""Chunking throughput: ``python -m infinibatch_like chunk`` against ``split --filter gzip``.

The input is the bench corpus (``corpus.py``, default 300,000 lines) decompressed into one
plain text file, so that both tools read the same uncompressed bytes. Each repetition runs,
interleaved, in one process each:

- ``split -l N --filter 'gzip > $FILE' corpus.txt``: GNU coreutils, one gzip per chunk
  (level 6), chunks written one after the other;
- ``python -m infinibatch_like chunk corpus.txt --items-per-chunk N --compress gz``
  with 1 and with 2 workers (the file is cut into `--split-bytes` ranges done in parallel;
  the output is the same for both), checksums and index included.

Reported: the median wall-clock time of each, input MB/s, output size, the ratio of
split's time to ours (> 1: ours is faster) and the 2-worker speed-up (ceiling about 1.5x
on a 2-core machine shared with the parent shell and the OS).

Run: ``python bench/bench_chunking.py [--lines 300000] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import REPO_ROOT, fmt, median, print_table, ratio, write_result
from corpus import build_corpus


def _plain_corpus(lines: int, directory: Path) -> Path:
    path = directory / "corpus.txt"
    with open(path, "wb") as out:
        for chunk in build_corpus(lines=lines):
            with gzip.open(chunk, "rb") as source:
                shutil.copyfileobj(source, out)
    return path


def _timed(command: list[str] | str, out: Path, env: dict[str, str]) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    subprocess.run(command, cwd=out, env=env, check=True, shell=isinstance(command, str))
    elapsed = time.perf_counter() - started
    size = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return elapsed, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--items-per-chunk", type=int, default=10_000)
    parser.add_argument("--split-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with tempfile.TemporaryDirectory(prefix="bench_chunking_") as tmp:
        work = Path(tmp)
        corpus = _plain_corpus(args.lines, work)
        megabytes = corpus.stat().st_size / 1e6
        n = str(args.items_per_chunk)
        commands: dict[str, list[str] | str] = {
            "split + gzip": f"split -l {n} --filter 'gzip > $FILE.gz' {corpus} chunk-",
        }
        for workers in (1, 2):
            commands[f"chunk, {workers} worker{'s' if workers > 1 else ''}"] = [
                sys.executable, "-m", "infinibatch_like", "chunk", str(corpus),
                "--out", ".", "--items-per-chunk", n, "--compress", "gz", "--quiet",
                "--workers", str(workers), "--split-bytes", str(args.split_bytes),
            ]  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in commands}
        sizes: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, command in commands.items():
                elapsed, sizes[name] = _timed(command, work / "out", env)
                times[name].append(elapsed)
    medians = {name: median(values) for name, values in times.items()}
    reference = medians["split + gzip"]
    rows = [
        [name, seconds, megabytes / seconds, sizes[name] / 1e6, ratio(reference, seconds)]
        for name, seconds in medians.items()
    ]
    print(f"corpus: {args.lines:,} lines, {megabytes:.1f} MB of plain text, {n} lines a chunk")
    print_table(
        f"median of {args.repeat} interleaved runs",
        ["tool", "seconds", "input MB/s", "output MB", "split time / this"],
        rows,
    )
    speedup = ratio(medians["chunk, 1 worker"], medians["chunk, 2 workers"])
    print(f"\n2 workers vs 1: {fmt(speedup)}x")
    write_result(
        "chunking",
        {
            "lines": args.lines,
            "megabytes": megabytes,
            "items_per_chunk": args.items_per_chunk,
            "times": times,
            "sizes": sizes,
            "speedup_2_workers": speedup,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
