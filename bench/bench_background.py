"""Background execution: PrefetchIterator and ParallelMapIterator, as ratios measured in one run.

(a) gzip chunks -> chunked_dataset_iterator (blockwise shuffle 100,000) -> tokenize ->
    BucketedReadaheadBatchIterator, against the same pipeline in single-process infinibatch
    0.1.1 (same seed, same batches). Our configurations, measured side by side:
      single      everything in the consumer's process (MapIterator);
      parallel    the next 2 chunks read in threads (read_ahead_chunks=2), tokenize in
                  ParallelMapIterator(2 processes, 500 items per task, 8 tasks in flight);
      +prefetch   as parallel, with a process PrefetchIterator of 10,000 items after
                  chunked_dataset_iterator: chunks are read (2 ahead, in threads), split
                  and shuffled in the prefetcher's process (the judged configuration).
    Besides wall-clock ratios, the CPU time of each run (consumer + worker processes) is
    recorded: with 2 cores, 2 * CPU(infinibatch) / CPU(ours) bounds the possible speed-up.
(b) a ~1 ms CPU-bound transform: ParallelMapIterator(2 processes) vs MapIterator;
(c) a producer and a consumer of 1 ms each: PrefetchIterator (process mode) vs none, and
    thread mode with an I/O-bound (sleeping) producer and a consumer that waits (as a
    training step waits for the GPU) rather than spinning (which would hold the GIL);
(d) restore latency (fresh pipeline + setstate + first batch) of the judged (a) pipeline
    with vs without the background stages;
(e) the cost of the snapshots that make checkpoints exact: throughput of a cheap pipeline
    behind a thread PrefetchIterator and a ParallelMapIterator with the default snapshot
    every 100 items, against (practically) no snapshots.

Wall-clock time is the clock here (the point is parallelism); each figure is the median of
``--reps`` runs. Run ``python bench/bench_background.py [--quick]``; results go to
``bench/results/background.json``.
"""

from __future__ import annotations

import argparse
import itertools
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import _util
from _util import median, print_table, verdict
from corpus import build_corpus, read_chunk

import infinibatch_like.iterators as ours
from infinibatch_like.datasets import chunked_dataset_iterator as ours_chunked

BLOCK = 100_000
READ_AHEAD = 10_000
TOKENS_PER_BATCH = 2048
PREFETCH = 10_000
PIECE = 3


def tokenize(line: str) -> list[int]:
    """A subword-style tokenizer: lower-case words cut into 3-letter pieces, hashed to ids."""
    ids = []
    for word in line.lower().split():
        for start in range(0, len(word), PIECE):
            ids.append(hash(word[start : start + PIECE]) % 50_000)
    return ids


def batch_size_for(longest: list[int]) -> int:
    return max(1, TOKENS_PER_BATCH // max(1, len(longest)))


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def busy_1ms(x: int) -> int:
    spin(0.001)
    return x


def sleep_1ms(x: int) -> int:
    time.sleep(0.001)
    return x


def timed(run: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


# -- (a) the pipeline ----------------------------------------------------------------------


def infinibatch_pipeline(chunks: list[str]) -> Any:
    from infinibatch import datasets, iterators

    samples = datasets.chunked_dataset_iterator(chunks, read_chunk, BLOCK, seed=1)
    tokens = iterators.MapIterator(samples, tokenize)
    return iterators.BucketedReadaheadBatchIterator(
        tokens, read_ahead=READ_AHEAD, key=len, batch_size=batch_size_for, seed=2
    )


def ours_pipeline(chunks: list[str], config: str = "+prefetch") -> Any:
    """Our pipeline in one of the configurations of the module docstring."""
    background = config != "single"
    samples = ours_chunked(
        chunks, read_chunk, BLOCK, seed=1, read_ahead_chunks=2 if background else 0
    )
    if config == "+prefetch":
        samples = ours.PrefetchIterator(samples, PREFETCH)
    if background:
        tokens: Any = ours.ParallelMapIterator(samples, tokenize, 2, 500, tasks_in_flight=8)
    else:
        tokens = ours.MapIterator(samples, tokenize)
    return ours.BucketedReadaheadBatchIterator(
        tokens, read_ahead=READ_AHEAD, key=len, batch_size=batch_size_for, seed=2
    )


CONFIGS = ("single", "parallel", "+prefetch")
JUDGED = "+prefetch"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_run(make: Callable[[], Any], lines: int) -> tuple[float, float, list[Any]]:
    """(wall seconds, CPU seconds of this process and its finished children, first batches)."""
    cpu_before, children_before = time.process_time(), children_cpu()
    started = time.perf_counter()
    pipeline = make()
    first = consume_lines(pipeline, lines)
    wall = time.perf_counter() - started
    close(pipeline)  # reaps the workers, so that their CPU time is counted
    cpu = time.process_time() - cpu_before + children_cpu() - children_before
    return wall, cpu, first


def consume_lines(pipeline: Any, lines: int) -> list[list[int]]:
    seen, first = 0, []
    for batch in pipeline:
        if len(first) < 3:
            first.append(batch)
        seen += len(batch)
        if seen >= lines:
            break
    return first


def close(pipeline: Any) -> None:
    if hasattr(pipeline, "close"):
        pipeline.close()


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpus and counts")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    quick = args.quick
    corpus_lines = 300_000 if quick else 1_000_000
    lines = 250_000 if quick else 600_000
    items_b = 400 if quick else 1000
    items_c = 300 if quick else 800

    chunks = build_corpus(corpus_lines, 10_000)
    results: dict[str, Any] = {"quick": quick, "reps": args.reps}
    rows = []

    # (a) -------------------------------------------------------------------------------
    lib, why = _util.load_library("infinibatch")
    if lib is None:
        print(f"[bench] infinibatch unavailable ({why}); (a) skipped", file=sys.stderr)
    else:
        wall: dict[str, list[float]] = {name: [] for name in ("infinibatch", *CONFIGS)}
        cpu: dict[str, list[float]] = {name: [] for name in wall}
        same = {name: True for name in CONFIGS}
        for _ in range(args.reps):
            seconds, cpu_seconds, reference = measured_run(
                lambda: infinibatch_pipeline(chunks), lines
            )
            wall["infinibatch"].append(seconds)
            cpu["infinibatch"].append(cpu_seconds)
            for config in CONFIGS:
                seconds, cpu_seconds, got = measured_run(
                    lambda config=config: ours_pipeline(chunks, config), lines
                )
                wall[config].append(seconds)
                cpu[config].append(cpu_seconds)
                same[config] = same[config] and got == reference
        ib_wall, ib_cpu = median(wall["infinibatch"]), median(cpu["infinibatch"])
        configs = {}
        for config in CONFIGS:
            speedup = ib_wall / median(wall[config])
            bound = 2 * ib_cpu / median(cpu[config])
            configs[config] = {
                "wall_s": wall[config],
                "cpu_s": cpu[config],
                "speedup": speedup,
                "cpu_bound_2_cores": bound,
                "same_batches": same[config],
            }
            judged = config == JUDGED
            rows.append(
                [
                    f"(a) pipeline, {config}, vs infinibatch 0.1.1",
                    speedup,
                    ">= 1.7" if judged else "-",
                    (verdict(speedup, 1.7, True) if judged else "")
                    + ("" if same[config] else " (BATCHES DIFFER)")
                    + f" (CPU bound {bound:.2f})",
                ]
            )
        results["a_pipeline"] = {
            "lines": lines,
            "infinibatch_wall_s": wall["infinibatch"],
            "infinibatch_cpu_s": cpu["infinibatch"],
            "configs": configs,
            "judged": JUDGED,
            "speedup": configs[JUDGED]["speedup"],
        }

    # (b) -------------------------------------------------------------------------------
    def run_map() -> None:
        list(ours.MapIterator(ours.NativeCheckpointableIterator(range(items_b)), busy_1ms))

    def run_parallel() -> None:
        with ours.ParallelMapIterator(
            ours.NativeCheckpointableIterator(range(items_b)), busy_1ms, 2, 10
        ) as pipeline:
            list(pipeline)

    plain = [timed(run_map) for _ in range(args.reps)]
    parallel = [timed(run_parallel) for _ in range(args.reps)]
    ratio_b = median(plain) / median(parallel)
    results["b_parallel_map"] = {
        "items": items_b,
        "map_s": plain,
        "parallel_s": parallel,
        "speedup": ratio_b,
    }
    rows.append(
        [
            "(b) 1 ms transform, 2 processes vs MapIterator",
            ratio_b,
            ">= 1.8",
            verdict(ratio_b, 1.8, True),
        ]
    )

    # (c) -------------------------------------------------------------------------------
    def produce_consume(producer: Callable[[int], int], prefetch: str | None) -> None:
        source: Any = ours.MapIterator(ours.NativeCheckpointableIterator(range(items_c)), producer)
        if prefetch in ("process", "thread"):
            source = ours.PrefetchIterator(source, 64, mode=prefetch)
        # The process case spins (CPU-bound consumer). The thread case waits like a
        # training step waiting for the GPU: a spinning consumer would hold the GIL for
        # whole switch intervals (5 ms) and starve any producer thread.
        step = time.sleep if prefetch in ("thread", "none-sleep") else spin
        for _ in source:
            step(0.001)
        close(source)

    def ratio_c(
        producer: Callable[[int], int], mode: str
    ) -> tuple[float, list[float], list[float]]:
        without = [timed(lambda: produce_consume(producer, None)) for _ in range(args.reps)]
        with_ = [timed(lambda: produce_consume(producer, mode)) for _ in range(args.reps)]
        return median(without) / median(with_), without, with_

    ratio_cp, without, with_ = ratio_c(busy_1ms, "process")
    results["c_prefetch_process"] = {
        "items": items_c,
        "without_s": without,
        "with_s": with_,
        "speedup": ratio_cp,
    }
    rows.append(
        [
            "(c) 1 ms producer + 1 ms consumer, process prefetch",
            ratio_cp,
            ">= 1.8",
            verdict(ratio_cp, 1.8, True),
        ]
    )

    def ratio_thread() -> tuple[float, list[float], list[float]]:
        without = [
            timed(lambda: produce_consume(sleep_1ms, "none-sleep")) for _ in range(args.reps)
        ]
        with_ = [timed(lambda: produce_consume(sleep_1ms, "thread")) for _ in range(args.reps)]
        return median(without) / median(with_), without, with_

    ratio_ct, without, with_ = ratio_thread()
    results["c_prefetch_thread_io"] = {
        "items": items_c,
        "without_s": without,
        "with_s": with_,
        "speedup": ratio_ct,
    }
    rows.append(
        [
            "(c) 1 ms sleeping producer + 1 ms consumer, thread prefetch",
            ratio_ct,
            ">= 1.8",
            verdict(ratio_ct, 1.8, True),
        ]
    )

    # (d) -------------------------------------------------------------------------------
    def restore_latency(config: str) -> list[float]:
        pipeline = ours_pipeline(chunks, config)
        for _ in itertools.islice(pipeline, 40):
            pass
        state = pipeline.getstate()
        close(pipeline)
        samples = []
        for _ in range(args.reps):
            started = time.perf_counter()
            fresh = ours_pipeline(chunks, config)
            fresh.setstate(state)
            next(fresh)
            samples.append(time.perf_counter() - started)
            close(fresh)
        return samples

    with_bg = restore_latency(JUDGED)
    without_bg = restore_latency("single")
    ratio_d = median(with_bg) / median(without_bg)
    results["d_restore_latency"] = {
        "with_background_s": with_bg,
        "without_s": without_bg,
        "ratio": ratio_d,
    }
    rows.append(
        [
            "(d) restore latency with / without background stages",
            ratio_d,
            "<= 1.5",
            verdict(ratio_d, 1.5, False),
        ]
    )

    # (e) -------------------------------------------------------------------------------
    items_e = 300_000 if quick else 1_000_000

    def snapshot_cost(stage: str) -> tuple[float, list[float], list[float]]:
        """Throughput with a snapshot every 100 items / with (practically) none."""

        def run(every: int) -> None:
            source: Any = ours.SelectManyIterator(
                ours.NativeCheckpointableIterator([list(range(1000))] * (items_e // 1000))
            )
            source = ours.BlockwiseShuffleIterator(source, 1000, 3)
            if stage == "prefetch":
                pipeline = ours.PrefetchIterator(source, 256, mode="thread", snapshot_every=every)
            else:
                pipeline = ours.ParallelMapIterator(source, abs, 2, 1000, snapshot_every=every)
            for _ in pipeline:
                pass
            close(pipeline)

        every_100, never = [], []
        for _ in range(args.reps):
            every_100.append(timed(lambda: run(100)))
            never.append(timed(lambda: run(10**9)))
        return median(never) / median(every_100), every_100, never

    for stage in ("prefetch", "parallel map"):
        ratio_e, every_100, never = snapshot_cost(stage)
        results[f"e_snapshot_cost_{stage.replace(' ', '_')}"] = {
            "items": items_e,
            "every_100_s": every_100,
            "none_s": never,
            "throughput_ratio": ratio_e,
        }
        rows.append(
            [
                f"(e) {stage}: throughput with snapshots every 100 items / without",
                ratio_e,
                ">= 0.95",
                verdict(ratio_e, 0.95, True),
            ]
        )

    print_table(
        "Background execution (ratios; wall clock, medians)",
        ["measure", "ratio", "target", "verdict"],
        rows,
    )
    _util.write_result("background", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
