"""The cost of per-stage statistics (`infinibatch_like.stats`) on the P1 pipeline.

P1 is the pipeline of ``bench_pipeline.py`` built with infinibatch_like: gzip chunks ->
block-wise shuffle (``chunked_dataset_iterator``) -> tokenize (``MapIterator(str.split)``)
-> ``BucketedReadaheadBatchIterator``. Each repetition builds fresh pipelines and consumes
``--measure-lines`` lines from each, in an order that rotates between repetitions:

* ``off``: statistics off (the default);
* ``on``: ``stats.enable(pipeline)`` (the default ``sample_every=128``);
* ``exact``: ``stats.enable(pipeline, sample_every=1)`` (every pull timed; for reference).

Reported: the median over repetitions of the ratio of each configuration's process CPU time
to the ``off`` run of the same repetition (the pipeline is single-threaded; CPU time is
robust on a shared machine), with wall-clock ratios alongside. Target: ``on`` / ``off``
at most 1.02.

On a busy machine those ratios scatter by several percent. A second, steadier figure
models the cost: the per-item cost of a probe, measured in a tight loop (a
``MapIterator`` over a list, with and without statistics, best of many short runs) times
the item pulls per P1 line that pass a probe (from ``stats.collect``), over the CPU time
per line of the ``off`` runs.

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


def probe_cost_ns(items: int = 200_000, reps: int = 15) -> float:
    """ns per item that statistics add to one stage (a map over a list), best of `reps`."""
    from infinibatch_like.iterators import MapIterator, NativeCheckpointableIterator

    data = list(range(items))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(reps):
        for on in (False, True):
            pipeline = MapIterator(NativeCheckpointableIterator(data), abs)
            if on:
                stats.enable(pipeline)
            watch = Stopwatch()
            for _ in pipeline:
                pass
            best[on] = min(best[on], watch.read()[1])
    # two probes (the source's and the map's) per item when on
    return (best[True] - best[False]) / items / 2 * 1e9


def probed_pulls_per_line(library: _util.Library, chunks: list[str], lines: int) -> float:
    """Item pulls through a probe per P1 line (every stage's items out, summed)."""
    pipeline = bench_pipeline.make_pipeline(library, chunks)
    stats.enable(pipeline)
    seen = 0
    while seen < lines:
        seen += len(next(pipeline))
    pulls = sum(entry["items_out"] or 0 for entry in stats.collect(pipeline))
    pipeline.close()
    return pulls / seen


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
    per_item = probe_cost_ns()
    pulls = probed_pulls_per_line(library, chunks, measure)
    off_ns = median(samples["off"].cpu) * 1e9 / measure
    modelled = 1 + per_item * pulls / off_ns
    print_table(
        "modelled cost (probe ns per item x probed pulls per line / CPU ns per line off)",
        ["probe ns/item", "probed pulls/line", "CPU ns/line off", "on/off", f"target <= {TARGET}"],
        [[per_item, pulls, off_ns, modelled, verdict(modelled, TARGET, False)]],
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
            "model": {
                "probe_ns_per_item": per_item,
                "probed_pulls_per_line": pulls,
                "off_cpu_ns_per_line": off_ns,
                "on_off": modelled,
            },
            "target": TARGET,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
