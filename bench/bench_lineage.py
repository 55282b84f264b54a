"""The cost of per-sample lineage (`infinibatch_like.stats.lineage`) on the P1 pipeline.

P1 (``bench_pipeline.py``): gzip chunks -> block-wise shuffle (``chunked_dataset_iterator``)
-> tokenize (``MapIterator(str.split)``) -> ``BucketedReadaheadBatchIterator``. With
lineage on, the training loop calls ``LineageLog.after_step`` after every batch, which
keeps the pipeline's state every ``--every`` batches (nothing per item); the origins of
any batch are then computed on demand by a traced twin replaying from the snapshot
before it (not measured here: it is not training time). The table also gives the log's
size per sample: the snapshots' JSON bytes over the samples they cover.

The measurement is `bench_stats.py`'s: rounds of two fresh pipelines in one process (on and
off, which one is built first alternating), taking turns consuming ``--segment`` lines,
``--pairs`` times; a round's figure is its median CPU ratio, the result the geometric mean
over rounds with its standard error, and control rounds (off / off) show the noise floor.
Lineage switched off is the plain P1: it costs nothing by construction.

Target: on / off <= 1.02 at <= 16 bytes per sample. Usage: ``python
bench/bench_lineage.py`` (about 4 minutes) or ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from functools import partial
from typing import Any

import _util
import bench_pipeline
from _util import print_table
from bench_stats import consume, paired_ratios, ratio_rows, summarize
from corpus import build_corpus

from infinibatch_like.stats.lineage import LineageLog

TARGET = 1.02
MOST_BYTES = 16


class Logged:
    """A training loop's view of P1 with lineage on: every batch goes through
    `LineageLog.after_step`; counts the samples, for the log's bytes per sample."""

    def __init__(self, pipeline: Any, every: int) -> None:
        self.pipeline, self.log, self.samples = pipeline, LineageLog(every), 0
        self.log.after_step(-1, pipeline)
        self._batches = self._logged()

    def _logged(self) -> Iterator[Any]:
        pipeline, after_step = self.pipeline, self.log.after_step
        for step, batch in enumerate(pipeline):
            after_step(step, pipeline)
            yield batch

    def __next__(self) -> Any:
        batch = next(self._batches)
        self.samples += len(batch)
        return batch

    def bytes_per_sample(self) -> float:
        size = sum(len(json.dumps(state)) for _, state in self.log.snapshots)
        return size / max(1, self.samples)

    def close(self) -> None:
        self.pipeline.close()


def run_round(
    library: _util.Library,
    chunks: list[str],
    on: int | None,
    segment: int,
    pairs: int,
    every: int,
    sizes: list[float],
) -> list[float]:
    """Two fresh pipelines, lineage on in pipeline `on` (0, 1, or None for a control);
    the logged one's bytes per sample are appended to `sizes`."""
    pipelines = [
        Logged(bench_pipeline.make_pipeline(library, chunks), every)
        if index == on
        else bench_pipeline.make_pipeline(library, chunks)
        for index in range(2)
    ]
    for pipeline in pipelines:
        consume(pipeline, segment)
    takes = [partial(consume, pipeline, segment) for pipeline in pipelines]
    ratios = paired_ratios(takes, 1 if on is None else on, pairs)
    for pipeline in pipelines:
        if isinstance(pipeline, Logged):
            sizes.append(pipeline.bytes_per_sample())
        pipeline.close()
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and pairs")
    parser.add_argument("--segment", type=int, default=20_000, help="lines per segment")
    parser.add_argument("--every", type=int, default=100, help="batches between snapshots")
    args = parser.parse_args(argv)
    corpus_lines = 300_000 if args.quick else 1_000_000
    pairs, rounds = (6, 4) if args.quick else (10, 16)
    chunks = build_corpus(corpus_lines)
    library = _util.load_libraries(["infinibatch_like"]).get("infinibatch_like")
    if library is None:
        print("infinibatch_like cannot be imported", file=sys.stderr)
        return 1
    on_rounds, control_rounds, sizes = [], [], []
    for index in range(rounds):
        on_rounds.append(
            run_round(library, chunks, index % 2, args.segment, pairs, args.every, sizes)
        )
        if index % 2:
            control_rounds.append(
                run_round(library, chunks, None, args.segment, pairs, args.every, sizes)
            )
        print(f"  round {index + 1}/{rounds} done", flush=True)
    result = summarize(on_rounds, control_rounds)
    print_table(
        f"lineage cost on P1 ({corpus_lines:,}-line corpus, {pairs} pairs of "
        f"{args.segment:,}-line segments per round, a snapshot every {args.every} batches)",
        ["measure", "rounds", "ratio", "standard error", f"target <= {TARGET}"],
        ratio_rows(result, TARGET),
    )
    per_sample = max(sizes)
    print(
        f"\nlineage log: at most {per_sample:.3f} bytes per sample over the rounds "
        f"(target <= {MOST_BYTES})"
    )
    _util.write_result(
        "lineage-quick" if args.quick else "lineage",
        {**result, "target": TARGET, "bytes_per_sample": per_sample, "every": args.every},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
