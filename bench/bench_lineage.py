"""The cost of per-sample lineage (`infinibatch_like.stats.lineage`) on the P1 pipeline.

P1 (``bench_pipeline.py``): gzip chunks -> block-wise shuffle (``chunked_dataset_iterator``)
-> tokenize (``MapIterator(str.split)``) -> ``BucketedReadaheadBatchIterator``. With
lineage on, the chunks are read with ``traced_chunks`` (every line travels as an
``[origin, line]`` pair), the tokenizer and the bucketing key and batch size apply to the
value (``on_value``, ``of_value``): every sample of every batch names its chunk and line.

The measurement is `bench_stats.py`'s: rounds of two fresh pipelines in one process (on and
off, which one is built first alternating), taking turns consuming ``--segment`` lines,
``--pairs`` times; a round's figure is its median CPU ratio, the result the geometric mean
over rounds with its standard error, and control rounds (off / off) show the noise floor.
Lineage switched off is the plain P1: it costs nothing by construction.

Target: on / off <= 1.02. Usage: ``python bench/bench_lineage.py`` (about 4 minutes) or
``--quick``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import _util
import bench_pipeline
from _util import print_table
from bench_stats import consume, paired_ratios, ratio_rows, summarize
from corpus import build_corpus

from infinibatch_like.stats.lineage import of_value, on_value, traced_chunks

TARGET = 1.02


def traced_batch_size(longest: list[Any]) -> int:
    return bench_pipeline.batch_size_for(longest[1])


def traced_pipeline(library: _util.Library, chunks: list[str]) -> Any:
    """P1 with lineage on."""
    samples = library.datasets.chunked_dataset_iterator(
        chunks,
        traced_chunks(bench_pipeline.counting_read_chunk, chunks),
        buffer_size=bench_pipeline.BUFFER_SIZE,
        seed=1,
    )
    tokens = library.iterators.MapIterator(samples, on_value(bench_pipeline.tokenize))
    return library.iterators.BucketedReadaheadBatchIterator(
        tokens,
        read_ahead=bench_pipeline.READ_AHEAD,
        key=of_value(len),
        batch_size=traced_batch_size,
        seed=2,
    )


def run_round(
    library: _util.Library, chunks: list[str], on: int | None, segment: int, pairs: int
) -> list[float]:
    """Two fresh pipelines, lineage on in pipeline `on` (0, 1, or None for a control)."""
    pipelines = [
        traced_pipeline(library, chunks)
        if index == on
        else bench_pipeline.make_pipeline(library, chunks)
        for index in range(2)
    ]
    for pipeline in pipelines:
        consume(pipeline, segment)
    takes = [partial(consume, pipeline, segment) for pipeline in pipelines]
    ratios = paired_ratios(takes, 1 if on is None else on, pairs)
    for pipeline in pipelines:
        pipeline.close()
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and pairs")
    parser.add_argument("--segment", type=int, default=20_000, help="lines per segment")
    args = parser.parse_args(argv)
    corpus_lines = 300_000 if args.quick else 1_000_000
    pairs, rounds = (6, 4) if args.quick else (10, 16)
    chunks = build_corpus(corpus_lines)
    library = _util.load_libraries(["infinibatch_like"]).get("infinibatch_like")
    if library is None:
        print("infinibatch_like cannot be imported", file=sys.stderr)
        return 1
    on_rounds, control_rounds = [], []
    for index in range(rounds):
        on_rounds.append(run_round(library, chunks, index % 2, args.segment, pairs))
        if index % 2:
            control_rounds.append(run_round(library, chunks, None, args.segment, pairs))
        print(f"  round {index + 1}/{rounds} done", flush=True)
    result = summarize(on_rounds, control_rounds)
    print_table(
        f"lineage cost on P1 ({corpus_lines:,}-line corpus, {pairs} pairs of "
        f"{args.segment:,}-line segments per round)",
        ["measure", "rounds", "ratio", "standard error", f"target <= {TARGET}"],
        ratio_rows(result, TARGET),
    )
    _util.write_result("lineage-quick" if args.quick else "lineage", {**result, "target": TARGET})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
