"""Sharded worker processes against their ceiling: ShardedIterator(workers=2) running the P1
pipeline, single-process infinibatch 0.1.1, and two fully independent half pipelines.

P1 (from bench_background.py): gzip chunks -> chunked_dataset_iterator (blockwise shuffle
100,000) -> tokenize -> BucketedReadaheadBatchIterator. Measured side by side, interleaved,
``--reps`` times each, consuming the same number of lines:

  infinibatch   P1 in one process, infinibatch 0.1.1;
  sharded       ShardedIterator(factory, num_shards=2, workers=2, buffer_size=--buffer):
                each worker process runs P1 over half of the chunks (shard s:
                chunks[s::2], seeds derived from s); only finished batches cross the
                process boundary;
  sharded-8     the same with 8 shards (4 per worker; block and read-ahead / 4 per shard);
  ceiling       two independent processes started together, each running P1 (this
                library, one process) over half of the chunks and half of the lines, with
                nothing exchanged: the best two processes can do on this machine;
  ceiling-gc    the same, each process with the garbage collector settings of the
                library's worker processes (`set_worker_gc`'s defaults): how much of
                sharded's speed comes from those settings rather than from the sharding;
  floor         the ceiling's two processes, each also pickling and unpickling every batch
                it makes: what moving the batches costs, without a process boundary.

and, with batches collated by `Padded` (a batch's token lists padded into one int32
buffer, as a collate function makes a tensor) in both runs:

  sharded-collated, ceiling-collated.

And, in this one process, what transferring the batches costs a half pipeline: two
half pipelines interleaved in 10,000-line segments, one pickling (or pickling and
unpickling) its batches, CPU time ratio over 8 rounds of 8 pairs.

Reports wall-clock ratios: ceiling / sharded (target >= 0.9: within 10 % of the ceiling),
as the geometric mean over repetitions of each repetition's ratio (the runs of a
repetition are back to back, in alternating order, so a drift of the machine's speed
cancels out), with its standard error and range; and the speed-up over infinibatch, with
the CPU time of every run (consumer and worker processes, medians). Also, for
docs/howto/elastic.md: the JSON size of a P1 ShardedIterator state per shard, and the
spread of items per rank, (max - min) / mean, of 64 shards over 1,000 chunks of 5,000 to
15,000 lines on 2 to 8 ranks. Run
``python bench/bench_sharded.py [--quick]``; results go to ``bench/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import pickle
import random
import sys
import time
from array import array
from functools import partial
from typing import Any

import _util
from _util import median, print_table, verdict
from bench_background import (
    BLOCK,
    READ_AHEAD,
    batch_size_for,
    children_cpu,
    infinibatch_pipeline,
    measured_run,
    tokenize,
)
from bench_stats import consume, paired_ratios, round_mean
from corpus import build_corpus, read_chunk

import infinibatch_like.iterators as ours
from infinibatch_like.background.worker_gc import DEFAULT, apply
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed.sharded import ShardedIterator, owned_shards

WORKERS = 2


class Padded:
    """A collated batch: `rows` token lists padded to `cols` tokens, as one int32 buffer
    (what a collate function turns into a tensor); ``len()`` is its number of rows."""

    __slots__ = ("cols", "data", "rows")

    def __init__(self, batch: list[list[int]]) -> None:
        self.rows, self.cols = len(batch), max(map(len, batch))
        self.data = array("i")
        for tokens in batch:
            self.data.extend(tokens)
            self.data.extend(itertools.repeat(0, self.cols - len(tokens)))

    def __len__(self) -> int:
        return self.rows


class P1Shard:
    """``factory(shard, num_shards)``: P1 over the shard's chunks, its sizes divided among
    the shards of a worker so that a worker holds as much as one P1; batches `Padded` if
    `collated`."""

    def __init__(self, chunks: list[str], collated: bool = False) -> None:
        self.chunks, self.collated = chunks, collated

    def __call__(self, shard: int, num_shards: int) -> ours.CheckpointableIterator[Any]:
        per_worker = max(1, num_shards // WORKERS)
        samples = chunked_dataset_iterator(
            self.chunks[shard::num_shards], read_chunk, BLOCK // per_worker, seed=1 + shard
        )
        batches = ours.BucketedReadaheadBatchIterator(
            ours.MapIterator(samples, tokenize),
            read_ahead=READ_AHEAD // per_worker,
            key=len,
            batch_size=batch_size_for,
            seed=1000 + shard,
        )
        return ours.MapIterator(batches, Padded) if self.collated else batches


def sharded(
    chunks: list[str], shards: int, buffer_size: int, collated: bool = False
) -> ShardedIterator[Any]:
    factory = P1Shard(chunks, collated)
    return ShardedIterator(factory, shards, 0, 1, workers=WORKERS, buffer_size=buffer_size)


def _half(
    chunks: list[str], half: int, lines: int, collated: bool, round_trip: bool, worker_gc: bool
) -> None:
    if worker_gc:
        apply(DEFAULT)
    pipeline = P1Shard(chunks, collated)(half, WORKERS)
    seen = 0
    for batch in pipeline:
        if round_trip:
            batch = pickle.loads(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
        seen += len(batch)
        if seen >= lines:
            return


def ceiling_run(
    chunks: list[str],
    lines: int,
    collated: bool = False,
    round_trip: bool = False,
    worker_gc: bool = False,
) -> tuple[float, float]:
    """(wall, CPU) of two independent half pipelines run at the same time (each pickling
    and unpickling every batch if `round_trip`; with the collector settings of the
    library's worker processes if `worker_gc`)."""
    context = multiprocessing.get_context("fork")
    children_before = children_cpu()
    started = time.perf_counter()
    processes = [
        context.Process(
            target=_half,
            args=(chunks, half, lines // WORKERS, collated, round_trip, worker_gc),
        )
        for half in range(WORKERS)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    wall = time.perf_counter() - started
    return wall, children_cpu() - children_before


def _take(pipeline: Any, lines: int, transfer: str) -> float:
    """CPU seconds to take `lines` lines of batches, each pickled (`transfer` "pickle") or
    pickled and unpickled ("round trip")."""
    started = time.process_time()
    seen = 0
    while seen < lines:
        batch = next(pipeline)
        data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        if transfer == "round trip":
            batch = pickle.loads(data)
        seen += len(batch)
    return time.process_time() - started


def transfer_cost(
    chunks: list[str], transfer: str, rounds: int = 8, pairs: int = 8
) -> tuple[float, float]:
    """The CPU cost of `transfer` on a half pipeline, measured in this process: per round,
    two fresh half pipelines take turns consuming 10,000-line segments, one of them
    transferring its batches; (geometric mean of the rounds' median ratio, its standard
    error)."""
    ratios_by_round = []
    for index in range(rounds):
        pipelines = [P1Shard(chunks)(0, WORKERS) for _ in range(2)]
        measured = index % 2
        for pipeline in pipelines:
            consume(pipeline, 10_000)
        takes = [
            partial(_take, pipeline, 10_000, transfer)
            if which == measured
            else partial(consume, pipeline, 10_000)
            for which, pipeline in enumerate(pipelines)
        ]
        ratios_by_round.append(paired_ratios(takes, measured, pairs))
    return round_mean(ratios_by_round)


def state_bytes_per_shard(chunks: list[str], shards: int) -> float:
    pipeline: ShardedIterator[Any] = ShardedIterator(P1Shard(chunks), shards, 0, 1)
    for _ in itertools.islice(pipeline, 100):
        pass
    size = len(json.dumps(pipeline.getstate()))
    pipeline.close()
    return size / shards


def spread_per_rank(shards: int = 64, chunks: int = 1000) -> dict[int, float]:
    """(max - min) / mean of the lines per rank, for 2 to 8 ranks."""
    rng = random.Random(0)
    sizes = [rng.randint(5_000, 15_000) for _ in range(chunks)]
    per_shard = [sum(sizes[shard::shards]) for shard in range(shards)]
    spreads = {}
    for ranks in range(2, 9):
        lines = [
            sum(per_shard[shard] for shard in owned_shards(shards, rank, ranks))
            for rank in range(ranks)
        ]
        spreads[ranks] = (max(lines) - min(lines)) / (sum(lines) / ranks)
    return spreads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpus and counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--buffer", type=int, default=256, help="ShardedIterator buffer_size")
    args = parser.parse_args(argv)
    corpus_lines = 300_000 if args.quick else 1_000_000
    lines = 250_000 if args.quick else 600_000
    chunks = build_corpus(corpus_lines, 10_000)

    lib, why = _util.load_library("infinibatch")
    buffer = args.buffer

    def pipeline_run(make: Any) -> Any:
        return lambda: measured_run(make, lines)[:2]

    runs: dict[str, Any] = {
        "sharded": pipeline_run(lambda: sharded(chunks, 2, buffer)),
        "sharded-8": pipeline_run(lambda: sharded(chunks, 8, buffer)),
        "ceiling": lambda: ceiling_run(chunks, lines),
        "ceiling-gc": lambda: ceiling_run(chunks, lines, worker_gc=True),
        "floor": lambda: ceiling_run(chunks, lines, round_trip=True),
        "sharded-collated": pipeline_run(lambda: sharded(chunks, 2, buffer, collated=True)),
        "ceiling-collated": lambda: ceiling_run(chunks, lines, collated=True),
    }
    if lib is None:
        print(f"[bench] infinibatch unavailable ({why}); skipped", file=sys.stderr)
    else:
        runs = {"infinibatch": pipeline_run(lambda: infinibatch_pipeline(chunks)), **runs}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(args.reps):  # alternate the order, so that a drift favours no run
        for name, run in list(runs.items())[:: 1 if rep % 2 == 0 else -1]:
            seconds, cpu_seconds = run()
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)

    rows = []
    results: dict[str, Any] = {
        "quick": args.quick,
        "reps": args.reps,
        "lines": lines,
        "buffer_size": buffer,
        "wall_s": wall,
        "cpu_s": cpu,
    }
    comparisons = [
        ("sharded", "ceiling"),
        ("sharded-8", "ceiling"),
        ("sharded", "ceiling-gc"),
        ("floor", "ceiling"),
        ("sharded", "floor"),
        ("sharded-collated", "ceiling-collated"),
    ]
    for name, reference in comparisons:
        per_rep = [ref / this for ref, this in zip(wall[reference], wall[name], strict=True)]
        to_reference, error = round_mean([[ratio] for ratio in per_rep])
        results[f"{name}_to_{reference}"] = {
            "geometric_mean": to_reference,
            "standard_error": error,
            "per_repetition": per_rep,
            "of_medians": median(wall[reference]) / median(wall[name]),
        }
        target = reference == "ceiling" or name == "sharded-collated"
        rows.append(
            [
                f"{reference} / {name}",
                to_reference,
                ">= 0.9" if target else "-",
                (verdict(to_reference, 0.9, True) if target else "")
                + f" (+- {error:.3f}; {min(per_rep):.2f} to {max(per_rep):.2f})",
            ]
        )
    if "infinibatch" in wall:
        for name in ("sharded", "sharded-8", "ceiling"):
            speedup = median(wall["infinibatch"]) / median(wall[name])
            results[f"{name}_speedup_vs_infinibatch"] = speedup
            rows.append([f"{name}: speed-up vs infinibatch 0.1.1", speedup, "-", ""])
    for name in wall:
        rows.append(
            [
                f"{name}: median wall s / CPU s",
                median(wall[name]),
                "-",
                f"CPU {median(cpu[name]):.2f} s",
            ]
        )
    for transfer in ("pickle", "round trip"):
        cost, error = transfer_cost(chunks, transfer)
        results[f"{transfer.replace(' ', '_')}_cost"] = {"ratio": cost, "standard_error": error}
        rows.append(
            [f"half pipeline, in one process: {transfer} / none", cost, "-", f"+- {error:.3f}"]
        )
    print_table(
        "Sharded workers vs the ceiling (wall clock; ratios: geometric means over repetitions)",
        ["measure", "value", "target", "verdict"],
        rows,
    )
    _util.write_result("sharded", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
