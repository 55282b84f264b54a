"""Batched transforms: P1 with a real tokenizer, per item (infinibatch 0.1.1) against one
call per batch (`BatchMapIterator`), measured in one run.

Pipeline (same seeds, same batches for every configuration)::

    chunked_dataset_iterator(chunks, read_chunk, buffer_size=100_000, seed=1)
    -> tokenize with a byte-pair-encoding tokenizer of the ``tokenizers`` package, trained
       at start-up on the first chunks of the bench corpus (nothing downloaded)
    -> BucketedReadaheadBatchIterator(read_ahead=10_000, key=len, 2048 tokens a batch, seed=2)

Configurations:
  infinibatch         infinibatch 0.1.1's MapIterator: ``tokenizer.encode(line).ids`` per line;
  ours per item       this library's MapIterator, the same call;
  ours batched        ``BatchMapIterator(..., encode_batch, 1000)``: one
                      ``tokenizer.encode_batch(lines)`` per 1,000 lines (which the tokenizer
                      runs on every core);
  ours batched fast   the same with ``encode_batch_fast`` (no character offsets: what a
                      training pipeline needs of the ids alone);
  ours 2 processes    ``ParallelMapIterator(..., batched=True)``: 2 worker processes, each
                      calling ``encode_batch_fast`` on tasks of 1,000 lines.

Throughput is lines/s over the first ``--lines`` lines, wall clock (the batch call uses
both cores: that is the point), median of ``--reps`` interleaved repetitions; the batches of
every configuration are checked to be identical. Target: the best batched configuration
>= 2x infinibatch.

Run ``python bench/bench_batched.py [--quick]``; results go to ``bench/results/batched.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import _util
from _util import median, print_table, verdict
from corpus import build_corpus, read_chunk

BUFFER_SIZE = 100_000
READ_AHEAD = 10_000
TOKENS_PER_BATCH = 2048
BATCH_CALL = 1000


def train_tokenizer(chunks: list[str], vocab_size: int) -> Any:
    """A BPE tokenizer trained on the lines of `chunks`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(
        (line for chunk in chunks for line in read_chunk(chunk)), trainer=trainer
    )
    return tokenizer


def batch_size_for(longest: list[int]) -> int:
    return max(1, TOKENS_PER_BATCH // max(1, len(longest)))


def pipeline(lib: _util.Library, chunks: list[str], tokenizer: Any, batched: str) -> Any:
    samples = lib.datasets.chunked_dataset_iterator(
        chunks, read_chunk, buffer_size=BUFFER_SIZE, seed=1
    )
    if batched:
        call = tokenizer.encode_batch if batched == "batch" else tokenizer.encode_batch_fast

        def encode_batch(lines: list[str]) -> list[list[int]]:
            return [encoding.ids for encoding in call(lines)]

        if batched == "processes":
            tokens = lib.iterators.ParallelMapIterator(
                samples, encode_batch, 2, BATCH_CALL, start_method="fork", batched=True
            )
        else:
            tokens = lib.iterators.BatchMapIterator(samples, encode_batch, BATCH_CALL)
    else:

        def encode(line: str) -> list[int]:
            ids: list[int] = tokenizer.encode(line).ids
            return ids

        tokens = lib.iterators.MapIterator(samples, encode)
    return lib.iterators.BucketedReadaheadBatchIterator(
        tokens, read_ahead=READ_AHEAD, key=len, batch_size=batch_size_for, seed=2
    )


def run(make: Callable[[], Any], lines: int) -> tuple[float, bytes]:
    """Lines/s over the first `lines` lines (whole batches), and a digest of the batches."""
    digest = hashlib.blake2b(digest_size=16)
    start = time.perf_counter()
    it = make()
    seen = 0
    for batch in it:
        seen += len(batch)
        digest.update(repr(batch).encode())
        if seen >= lines:
            break
    elapsed = time.perf_counter() - start
    if hasattr(it, "close"):
        it.close()
    return seen / elapsed, digest.digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lines", type=int, default=100_000)
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    lines = 20_000 if args.quick else args.lines
    chunks = build_corpus(lines=200_000)
    started = time.perf_counter()
    tokenizer = train_tokenizer(chunks[:2], 8000)
    trained_s = time.perf_counter() - started
    libs = _util.load_libraries(["infinibatch", "infinibatch_like"])
    configs: dict[str, Callable[[], Any]] = {}
    if "infinibatch" in libs:
        configs["infinibatch"] = lambda: pipeline(libs["infinibatch"], chunks, tokenizer, "")
    ours = libs["infinibatch_like"]
    configs["ours per item"] = lambda: pipeline(ours, chunks, tokenizer, "")
    configs["ours batched"] = lambda: pipeline(ours, chunks, tokenizer, "batch")
    configs["ours batched fast"] = lambda: pipeline(ours, chunks, tokenizer, "fast")
    configs["ours 2 processes"] = lambda: pipeline(ours, chunks, tokenizer, "processes")
    rates: dict[str, list[float]] = {name: [] for name in configs}
    digests: dict[str, set[bytes]] = {name: set() for name in configs}
    run(configs["ours batched"], 2000)  # warm-up: the tokenizer's thread pool
    for _ in range(reps):
        for name, make in configs.items():
            rate, digest = run(make, lines)
            rates[name].append(rate)
            digests[name].add(digest)
    same = len(set().union(*digests.values())) == 1
    base = median(rates["infinibatch"]) if "infinibatch" in rates else None
    rows = []
    for name, got in rates.items():
        rate = median(got)
        x = rate / base if base else None
        rows.append([name, f"{rate:,.0f}", "n/a" if x is None else f"{x:.2f}"])
    best = max(("ours batched", "ours batched fast", "ours 2 processes"),
               key=lambda name: median(rates[name]))
    batched_x = median(rates[best]) / base if base else None
    print_table(
        f"lines/s over the first {lines:,} lines (BPE trained in {trained_s:.1f} s)",
        ["configuration", "lines/s", "x infinibatch"],
        rows,
    )
    print(f"same batches in every configuration: {same}")
    print(f"target batched >= 2x infinibatch ({best}): {verdict(batched_x, 2.0, True)}")
    print(f"load average during the run: {os.getloadavg()}")
    _util.write_result(
        "batched" + ("-quick" if args.quick else ""),
        {
            "lines": lines,
            "rates": rates,
            "same_batches": same,
            "summary": {"best_batched": best, "batched_x_infinibatch": batched_x},
            "load_average": os.getloadavg(),
        },
    )


if __name__ == "__main__":
    main()
