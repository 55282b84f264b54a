"""The cost of per-stage statistics (`infinibatch_like.stats`) on the P1 pipeline.

P1 is the pipeline of ``bench_pipeline.py`` built with infinibatch_like: gzip chunks ->
block-wise shuffle (``chunked_dataset_iterator``) -> tokenize (``MapIterator(str.split)``)
-> ``BucketedReadaheadBatchIterator``. Each repetition builds fresh pipelines and consumes
``--measure-lines`` lines from each, in an order that rotates between repetitions:

* ``off``: statistics off (the default);
* ``on``: ``stats.enable(pipeline)`` (the default ``sample_every=32``);
* ``exact``: ``stats.enable(pipeline, sample_every=1)`` (every pull timed; for reference).

Reported: the median over repetitions of the ratio of each configuration's process CPU time
to the ``off`` run of the same repetition (the pipeline is single-threaded; CPU time is
robust on a shared machine), with wall-clock ratios alongside. Target: ``on`` / ``off``
at most 1.02.

Usage: ``python bench/bench_stats.py`` (about 2 minutes), ``--quick``, ``--in-memory``
(chunks pre-read: no gzip in the timings, so the per-item share of statistics is larger).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from typing import Any

import _util
import bench_pipeline
from _util import Samples, Stopwatch, median, print_table, verdict
from corpus import build_corpus, read_chunk

from infinibatch_like import stats

TARGET = 1.02

CONFIGS: dict[str, Callable[[Any], None]] = {
    "off": lambda pipeline: None,
    "on": stats.enable,
    "exact": lambda pipeline: stats.enable(pipeline, sample_every=1),
}


def run(library: _util.Library, chunks: list[str], lines: int, config: str) -> tuple[float, float]:
    """(wall, CPU) seconds to build P1, apply `config` and consume `lines` lines."""
    gc.collect()
    watch = Stopwatch()
    pipeline = bench_pipeline.make_pipeline(library, chunks)
    CONFIGS[config](pipeline)
    seen = 0
    while seen < lines:
        seen += len(next(pipeline))
    elapsed = watch.read()
    if config != "off":  # the statistics were really collected
        assert stats.collect(pipeline)[0]["items_out"] > 0
    pipeline.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lines and repeats")
    parser.add_argument("--lines", type=int, default=None, help="corpus size in lines")
    parser.add_argument("--measure-lines", type=int, default=None, help="lines per run")
    parser.add_argument("--reps", type=int, default=None, help="repetitions")
    parser.add_argument("--in-memory", action="store_true", help="read every chunk first")
    args = parser.parse_args(argv)
    corpus_lines = args.lines or (300_000 if args.quick else 1_000_000)
    measure = args.measure_lines or (150_000 if args.quick else 400_000)
    reps = args.reps or (4 if args.quick else 9)
    chunks = build_corpus(corpus_lines)
    if args.in_memory:
        bench_pipeline._in_memory.update((c, read_chunk(c)) for c in chunks)
    library = _util.load_libraries(["infinibatch_like"]).get("infinibatch_like")
    if library is None:
        print("infinibatch_like cannot be imported", file=sys.stderr)
        return 1
    names = list(CONFIGS)
    print(
        f"P1 over {corpus_lines:,} lines; {measure:,} lines per run; {reps} repetitions"
        + ("; chunks served from memory" if args.in_memory else ""),
        flush=True,
    )
    samples = {name: Samples() for name in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:  # rotate which configuration goes first
            samples[name].add(run(library, chunks, measure, name))
        print(f"  repetition {rep + 1}/{reps} done", flush=True)
    ratios = {
        name: {
            clock: median(
                [
                    n / d
                    for n, d in zip(
                        getattr(samples[name], clock), getattr(samples["off"], clock), strict=True
                    )
                ]
            )
            for clock in ("cpu", "wall")
        }
        for name in names
    }
    rows = [
        [
            name,
            median(samples[name].cpu) * 1e9 / measure,
            ratios[name]["cpu"],
            ratios[name]["wall"],
            verdict(ratios[name]["cpu"], TARGET, False) if name == "on" else "",
        ]
        for name in names
    ]
    print_table(
        "statistics cost on P1 (ratios: median over repetitions of run / off run)",
        ["config", "CPU ns/line", "CPU ratio", "wall ratio", f"target <= {TARGET}"],
        rows,
    )
    suffix = ("-quick" if args.quick else "") + ("-in-memory" if args.in_memory else "")
    _util.write_result(
        f"stats{suffix}",
        {
            "config": {
                "corpus_lines": corpus_lines,
                "measure_lines": measure,
                "reps": reps,
                "in_memory": args.in_memory,
            },
            "samples": {name: samples[name].summary() for name in names},
            "ratios": ratios,
            "target": TARGET,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
