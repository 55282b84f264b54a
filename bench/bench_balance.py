"""Items per shard and per rank: stride against ``index.shards`` (balanced by item count),
on chunks cut by ``python -m infinibatch_like chunk`` now and as earlier versions cut them.

The corpus: `--inputs` gzip text files of ``N + 1`` to ``2 N - 1`` lines each (uniformly
random, seed 0), with ``N = --items-per-chunk`` (defaults: 24 inputs, N = 11,000, about
400,000 lines), so that each input makes two chunks, as in a corpus of documents of
mixed sizes. The chunk tool cuts them (one worker, gzip chunks) into chunks of nearly equal
sizes per input; the earlier layout (one full chunk of N and a short remainder per input)
is computed from the line counts. Each layout is then split into `--shards` shards by
stride (``chunk_refs[shard::num_shards]``) and by ``balanced_shards``, and the shards over
2 ranks as `ShardedIterator` owns them (``shard % 2 == rank``).

Reported: items per shard, their spread ``(max - min) / mean`` (target: <= 2 % for the
balanced split of the tool's chunks), items per rank and the share of its steps that the
shorter rank pads (``(max - min) / max``); the chunk job's time and the part of it that
the counting read (each input decompressed once more to count its lines) takes. A second
table: 1,000 chunks of 5,000 to 15,000 lines in 64 shards over 2 to 8 ranks (the case of
``bench_sharded.py``), stride against balanced.

Run: ``python bench/bench_balance.py [--inputs 24] [--items-per-chunk 11000] [--shards 6]``.
"""

from __future__ import annotations

import argparse
import gzip
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import print_table, write_result

from infinibatch_like.distributed.sharded import owned_shards
from infinibatch_like.prepare import chunk_corpus
from infinibatch_like.prepare.balancing import balanced_shards
from infinibatch_like.prepare.plan import Job, line_pieces
from infinibatch_like.prepare.writer import _items

RANKS = 2


def spread(loads: list[int]) -> float:
    """(max - min) / mean."""
    return (max(loads) - min(loads)) * len(loads) / sum(loads)


def write_inputs(directory: Path, inputs: int, per_chunk: int) -> list[int]:
    """The gzip inputs; their line counts."""
    rng = random.Random(0)
    sizes = [rng.randint(per_chunk + 1, 2 * per_chunk - 1) for _ in range(inputs)]
    for number, size in enumerate(sizes):
        with gzip.open(directory / f"part-{number:03d}.txt.gz", "wt", compresslevel=1) as out:
            out.writelines(f"document {number}-{i} " + "w" * (i % 50) + "\n" for i in range(size))
    return sizes


def split(counts: list[int], shards: int) -> dict[str, list[int]]:
    """Items per shard of the stride and the balanced split of chunks of `counts`."""
    balanced = balanced_shards(enumerate(counts), shards)
    return {
        "stride": [sum(counts[shard::shards]) for shard in range(shards)],
        "balanced": [sum(counts[position] for position in shard) for shard in balanced],
    }


def per_rank(loads: list[int], ranks: int) -> list[int]:
    return [
        sum(loads[shard] for shard in owned_shards(len(loads), rank, ranks))
        for rank in range(ranks)
    ]


def counting_read_seconds(inputs: list[str], per_chunk: int) -> float:
    """The time the chunk tool's first read of every input (counting its lines) takes."""
    job = Job("lines", tuple(inputs), per_chunk, "gz", 64 << 20, "")
    started = time.perf_counter()
    for piece in line_pieces(inputs, 64 << 20):
        with _items(job, piece, None, check=False) as blocks:
            sum(len(block) for block in blocks)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=24)
    parser.add_argument("--items-per-chunk", type=int, default=11_000)
    parser.add_argument("--shards", type=int, default=6)
    args = parser.parse_args(argv)
    per_chunk, shards = args.items_per_chunk, args.shards

    workdir = Path(tempfile.mkdtemp(prefix="bench_balance_"))
    try:
        sizes = write_inputs(workdir, args.inputs, per_chunk)
        inputs = sorted(str(path) for path in workdir.glob("part-*.txt.gz"))
        started = time.perf_counter()
        index = chunk_corpus(
            inputs, str(workdir / "chunks"), items_per_chunk=per_chunk, workers=1,
            show_progress=False,
        )  # fmt: skip
        job_seconds = time.perf_counter() - started
        counting = counting_read_seconds(inputs, per_chunk)
        now = [chunk.items for chunk in index.chunks]
        shard_refs = index.shards(shards)
        items = dict(zip(index.chunk_refs, now, strict=True))
        assert [sum(items[ref] for ref in shard) for shard in shard_refs] == split(now, shards)[
            "balanced"
        ]
    finally:
        shutil.rmtree(workdir)
    earlier = [
        count for size in sizes for count in [per_chunk] * (size // per_chunk) + [size % per_chunk]
    ]
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for layout, counts in (("earlier: full + remainder", earlier), ("now: even", now)):
        for method, loads in split(counts, shards).items():
            ranks = per_rank(loads, RANKS)
            padding = (max(ranks) - min(ranks)) / max(ranks)
            rows.append([
                layout, method, " / ".join(f"{load:,}" for load in loads),
                f"{spread(loads):.2%}", " / ".join(f"{rank:,}" for rank in ranks),
                f"{padding:.1%}",
            ])  # fmt: skip
            results[f"{layout} | {method}"] = {
                "per_shard": loads, "spread": spread(loads), "per_rank": ranks, "padding": padding,
            }  # fmt: skip
    print_table(
        f"{args.inputs} inputs, {sum(sizes):,} lines, --items-per-chunk {per_chunk:,}: "
        f"{len(earlier)} chunks then, {len(now)} now; {shards} shards, {RANKS} ranks",
        ["chunks", "split", "items per shard", "spread", "items per rank", "shorter pads"],
        rows,
    )
    target = results["now: even | balanced"]["spread"]
    print(f"\nbalanced spread of the tool's chunks: {target:.2%} (target <= 2 %): "
          f"{'PASS' if target <= 0.02 else 'MISS'}")  # fmt: skip
    print(f"chunk job: {job_seconds:.2f} s (1 worker, gzip in and out), of which the counting "
          f"read: {counting:.2f} s ({counting / job_seconds:.0%})")  # fmt: skip

    rng = random.Random(0)
    uniform = [rng.randint(5_000, 15_000) for _ in range(1000)]
    rank_rows = []
    by_ranks: dict[str, dict[str, float]] = {}
    for method, loads in split(uniform, 64).items():
        spreads = {ranks: spread(per_rank(loads, ranks)) for ranks in range(2, 9)}
        rank_rows.append([method, *(f"{value:.1%}" for value in spreads.values())])
        by_ranks[method] = {str(ranks): value for ranks, value in spreads.items()}
    print_table(
        "1,000 chunks of 5,000 to 15,000 lines, 64 shards: spread of items per rank",
        ["split", *(f"{ranks} ranks" for ranks in range(2, 9))],
        rank_rows,
    )
    write_result("balance", {
        "config": vars(args), "input_lines": sizes, "chunks_earlier": earlier, "chunks_now": now,
        "results": results, "job_seconds": job_seconds, "counting_read_seconds": counting,
        "per_rank_spread_64_shards": by_ranks,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
