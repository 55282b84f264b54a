"""The cost of per-stage statistics (`infinibatch_like.stats`) on two workloads.

* P1, the pipeline of ``bench_pipeline.py`` built with infinibatch_like: gzip chunks ->
  block-wise shuffle (``chunked_dataset_iterator``) -> tokenize (``MapIterator(str.split)``)
  -> ``BucketedReadaheadBatchIterator``;
* the chain: ten ``MapIterator`` stages over a list, each applying a transform of about
  0.3 µs (a loop calibrated on this machine at start-up; its measured cost is printed),
  where the per-item cost of statistics weighs most among realistic stages.

The measurement interleaves two pipelines of a workload in this one process: each round
builds two fresh, identical pipelines, switches statistics on in one of them
(``stats.enable`` with its default ``sample_every``, or ``--sample-every``; in the
first-built pipeline in half of the rounds, in the second-built one in the other half),
and then lets them take turns consuming a segment each (``--segment`` lines of P1, or
``--chain-segment`` items of the chain), ``--pairs`` times, the order within a pair
alternating. A round's figure is the median over its pairs of (CPU time of the segment
with statistics) / (CPU time of the segment without); the result is the geometric mean
of the rounds' figures, with its standard error. Interleaving in one process keeps the
load of the machine out of the ratio; but two identical pipelines built side by side
still differ by a few percent by themselves (memory layout), so the rounds, each with
two new pipelines, are the independent samples, and there are many of them. Control
rounds run the same way with statistics off in both pipelines: their figure (second /
first) should be 1.00 within its standard error.

A second figure models the cost: the per-item cost of a probe, measured in a tight loop (a
``MapIterator`` over a list, with and without statistics, best of many short runs) times
the item pulls per P1 line that pass a probe (from ``stats.collect``), over the CPU time
per line without statistics.

Targets: at most 1.02 on P1, at most 1.03 on the chain. Usage: ``python
bench/bench_stats.py`` (about 5 minutes) or ``--quick``; ``--only p1`` or ``--only
chain``; ``--in-memory`` serves P1's chunks from memory (no gzip in the timings, so the
per-item share of statistics is larger).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any

import _util
import bench_pipeline
from _util import median, print_table, verdict
from corpus import build_corpus, read_chunk

from infinibatch_like import stats

TARGET = 1.02
CHAIN_TARGET = 1.03
CHAIN_STAGES = 10
CHAIN_TRANSFORM_S = 0.3e-6
DEFAULT_SAMPLE_EVERY = inspect.signature(stats.enable).parameters["sample_every"].default


@dataclass
class Workload:
    """Builds a pipeline and consumes `segment` units (lines, items) of it."""

    name: str
    build: Callable[[], Any]
    consume: Callable[[Any, int], float]
    segment: int


def consume(pipeline: Any, lines: int) -> float:
    """CPU seconds to take batches from `pipeline` until `lines` lines came."""
    started = time.process_time()
    seen = 0
    while seen < lines:
        seen += len(next(pipeline))
    return time.process_time() - started


def consume_items(pipeline: Any, items: int) -> float:
    """CPU seconds to take `items` items from `pipeline`."""
    started = time.process_time()
    collections.deque(islice(pipeline, items), maxlen=0)
    return time.process_time() - started


_loops = 1
"""Iterations of the chain's transform loop (calibrated by `calibrate_transform`)."""


def transform(x: int) -> int:
    """The chain's stage transform: about `CHAIN_TRANSFORM_S` of pure Python work."""
    for _ in range(_loops):
        x ^= 1
    return x


def transform_s(calls: int = 200_000) -> float:
    """CPU seconds per call of `transform` (best of 5)."""
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        collections.deque(map(transform, range(calls)), maxlen=0)
        best = min(best, time.process_time() - started)
    return best / calls


def calibrate_transform() -> float:
    """Set the loop count so that `transform` takes about `CHAIN_TRANSFORM_S`; its cost."""
    global _loops
    _loops = 1
    base = transform_s()
    _loops = 41
    per_loop = (transform_s() - base) / 40
    _loops = max(1, round(1 + (CHAIN_TRANSFORM_S - base) / per_loop))
    return transform_s()


def build_chain(items: int) -> Any:
    """Ten MapIterators of `transform` over a list of `items` integers."""
    from infinibatch_like.iterators import MapIterator, NativeCheckpointableIterator

    pipeline: Any = NativeCheckpointableIterator(list(range(items)))
    for _ in range(CHAIN_STAGES):
        pipeline = MapIterator(pipeline, transform)
    return pipeline


def paired_ratios(takes: Sequence[Callable[[], float]], measured: int, pairs: int) -> list[float]:
    """``takes[i]()`` consumes a segment of pipeline `i` (of two) and returns its CPU
    seconds: the ratio of pipeline `measured`'s over the other's, for `pairs` pairs of
    segments taken in turn, the order within a pair alternating."""
    ratios = []
    for pair in range(pairs):
        seconds = [0.0, 0.0]
        for index in (0, 1) if pair % 2 == 0 else (1, 0):
            seconds[index] = takes[index]()
        ratios.append(seconds[measured] / seconds[1 - measured])
    return ratios


def interleaved_round(
    workload: Workload, on: int | None, pairs: int, sample_every: int
) -> list[float]:
    """One round: two fresh pipelines (statistics on in pipeline `on`: 0, 1 or None) take
    turns consuming a segment; the ratio (pipeline `on`, or the second one if None, over
    the other) of each pair."""
    pipelines = [workload.build() for _ in range(2)]
    if on is not None:
        stats.enable(pipelines[on], sample_every)
    measured = 1 if on is None else on
    for pipeline in pipelines:  # the first block read, and the first lines
        workload.consume(pipeline, workload.segment)
    takes = [partial(workload.consume, pipeline, workload.segment) for pipeline in pipelines]
    ratios = paired_ratios(takes, measured, pairs)
    if on is not None:  # the statistics were really collected
        assert (stats.collect(pipelines[on])[0]["items_out"] or 0) > 0
    for pipeline in pipelines:
        pipeline.close()
    return ratios


def measure(workload: Workload, rounds: int, pairs: int, sample_every: int) -> dict[str, Any]:
    """`rounds` rounds with statistics on and half as many control rounds (off / off),
    alternating; their ratios by round, and the geometric means with standard errors."""
    on_rounds: list[list[float]] = []
    control_rounds: list[list[float]] = []
    for index in range(rounds):
        on_rounds.append(interleaved_round(workload, index % 2, pairs, sample_every))
        if index % 2 == 1 or rounds == 1:
            control_rounds.append(interleaved_round(workload, None, pairs, sample_every))
        print(f"  {workload.name}: round {index + 1}/{rounds} done", flush=True)
    return summarize(on_rounds, control_rounds)


def summarize(on_rounds: list[list[float]], control_rounds: list[list[float]]) -> dict[str, Any]:
    """The ratios by round of on/off and control rounds, and their geometric means with
    standard errors (what `ratio_rows` shows)."""
    on, on_error = round_mean(on_rounds)
    control, control_error = round_mean(control_rounds)
    return {
        "on_off_ratios_by_round": on_rounds,
        "control_ratios_by_round": control_rounds,
        "on_off": on,
        "on_off_standard_error": on_error,
        "control": control,
        "control_standard_error": control_error,
    }


def ratio_rows(result: dict[str, Any], target: float) -> list[list[Any]]:
    """The table rows of a `measure` result."""
    return [
        [
            "on / off",
            len(result["on_off_ratios_by_round"]),
            f"{result['on_off']:.4f}",
            f"{result['on_off_standard_error']:.4f}",
            verdict(result["on_off"], target, False),
        ],
        [
            "control: off / off",
            len(result["control_ratios_by_round"]),
            f"{result['control']:.4f}",
            f"{result['control_standard_error']:.4f}",
            "",
        ],
    ]


def probe_cost_ns(sample_every: int, items: int = 200_000, reps: int = 15) -> float:
    """ns per item that statistics add to one stage (a map over a list), best of `reps`."""
    from infinibatch_like.iterators import MapIterator, NativeCheckpointableIterator

    data = list(range(items))
    best = {False: float("inf"), True: float("inf")}
    for _ in range(reps):
        for on in (False, True):
            pipeline = MapIterator(NativeCheckpointableIterator(data), abs)
            if on:
                stats.enable(pipeline, sample_every)
            started = time.process_time()
            for _ in pipeline:
                pass
            best[on] = min(best[on], time.process_time() - started)
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
    parser.add_argument("--quick", action="store_true", help="fewer rounds and pairs")
    parser.add_argument("--only", choices=["p1", "chain"], help="one workload")
    parser.add_argument("--lines", type=int, default=None, help="corpus size in lines")
    parser.add_argument("--segment", type=int, default=20_000, help="lines per segment")
    parser.add_argument("--chain-segment", type=int, default=20_000, help="items per segment")
    parser.add_argument("--pairs", type=int, default=None, help="segment pairs per round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds with statistics on")
    parser.add_argument("--in-memory", action="store_true", help="read every chunk first")
    parser.add_argument("--sample-every", type=int, default=None, help="stats.enable's")
    args = parser.parse_args(argv)
    sample_every = args.sample_every or DEFAULT_SAMPLE_EVERY
    pairs = args.pairs or (6 if args.quick else 10)
    rounds = args.rounds or (4 if args.quick else 24)
    payload: dict[str, Any] = {
        "config": {
            "pairs_per_round": pairs,
            "rounds": rounds,
            "sample_every": sample_every,
        },
        "target": TARGET,
        "chain_target": CHAIN_TARGET,
    }
    if args.only != "p1":
        payload["chain"] = run_chain(args.chain_segment, rounds, pairs, sample_every)
    if args.only != "chain":
        p1 = run_p1(args, rounds, pairs, sample_every)
        if p1 is None:
            return 1
        payload.update(p1)
    suffix = ("-quick" if args.quick else "") + ("-in-memory" if args.in_memory else "")
    suffix += f"-{args.only}" if args.only else ""
    _util.write_result(f"stats{suffix}", payload)
    return 0


def run_chain(segment: int, rounds: int, pairs: int, sample_every: int) -> dict[str, Any]:
    """The chain of ten ~0.3 µs transforms: statistics on / off."""
    cost = calibrate_transform()
    items = (pairs + 1) * segment
    print(
        f"chain of {CHAIN_STAGES} MapIterators, transform {cost * 1e6:.3f} µs ({_loops} "
        f"loops); {rounds} rounds with statistics on and {max(1, rounds // 2)} control "
        f"rounds, {pairs} pairs of {segment:,}-item segments each",
        flush=True,
    )
    workload = Workload("chain", partial(build_chain, items), consume_items, segment)
    result = measure(workload, rounds, pairs, sample_every)
    print_table(
        f"statistics cost on a chain of {CHAIN_STAGES} {cost * 1e6:.2f} µs transforms: "
        "geometric mean over rounds of each round's median CPU ratio",
        ["measure", "rounds", "ratio", "standard error", f"target <= {CHAIN_TARGET}"],
        ratio_rows(result, CHAIN_TARGET),
    )
    return {"transform_s": cost, "transform_loops": _loops, "segment_items": segment, **result}


def run_p1(
    args: argparse.Namespace, rounds: int, pairs: int, sample_every: int
) -> dict[str, Any] | None:
    """P1: statistics on / off, and the model."""
    corpus_lines = args.lines or (300_000 if args.quick else 1_000_000)
    chunks = build_corpus(corpus_lines)
    if args.in_memory:
        bench_pipeline._in_memory.update((c, read_chunk(c)) for c in chunks)
    library = _util.load_libraries(["infinibatch_like"]).get("infinibatch_like")
    if library is None:
        print("infinibatch_like cannot be imported", file=sys.stderr)
        return None
    print(
        f"P1 over {corpus_lines:,} lines; {rounds} rounds with statistics on and "
        f"{max(1, rounds // 2)} control rounds, {pairs} pairs of {args.segment:,}-line "
        "segments each" + ("; chunks served from memory" if args.in_memory else ""),
        flush=True,
    )
    workload = Workload(
        "P1", partial(bench_pipeline.make_pipeline, library, chunks), consume, args.segment
    )
    result = measure(workload, rounds, pairs, sample_every)
    per_segment = consume_per_line(library, chunks, args.segment)
    print_table(
        "statistics cost on P1: geometric mean over rounds of each round's median CPU ratio",
        ["measure", "rounds", "ratio", "standard error", f"target <= {TARGET}"],
        ratio_rows(result, TARGET),
    )
    per_item = probe_cost_ns(sample_every)
    pulls = probed_pulls_per_line(library, chunks, 4 * args.segment)
    off_ns = per_segment * 1e9 / args.segment
    modelled = 1 + per_item * pulls / off_ns
    print_table(
        "modelled cost (probe ns per item x probed pulls per line / CPU ns per line off)",
        ["probe ns/item", "probed pulls/line", "CPU ns/line off", "on/off", f"target <= {TARGET}"],
        [[per_item, pulls, off_ns, f"{modelled:.4f}", verdict(modelled, TARGET, False)]],
    )
    return {
        "p1_config": {
            "corpus_lines": corpus_lines,
            "segment_lines": args.segment,
            "in_memory": args.in_memory,
        },
        **result,
        "model": {
            "probe_ns_per_item": per_item,
            "probed_pulls_per_line": pulls,
            "off_cpu_ns_per_line": off_ns,
            "on_off": modelled,
        },
    }


def round_mean(rounds: list[list[float]]) -> tuple[float, float]:
    """The geometric mean over rounds of each round's median ratio, and its standard
    error (as a ratio): every round's two pipelines differ a little by themselves (memory
    layout), so rounds, not pairs, are the independent samples."""
    logs = [math.log(median(ratios)) for ratios in rounds]
    mean = statistics.fmean(logs)
    error = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(mean), math.exp(error) - 1


def consume_per_line(library: _util.Library, chunks: list[str], segment: int) -> float:
    """Median CPU seconds per `segment` lines of P1 without statistics (after the first)."""
    pipeline = bench_pipeline.make_pipeline(library, chunks)
    consume(pipeline, segment)
    seconds = median([consume(pipeline, segment) for _ in range(5)])
    pipeline.close()
    return seconds


if __name__ == "__main__":
    sys.exit(main())
