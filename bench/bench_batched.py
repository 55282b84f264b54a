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
                      calling ``encode_batch_fast`` on tasks of 2,000 lines (the default 4
                      tasks in flight then cover the consumer's pauses: reading a shuffle
                      block of 100,000 lines); the chunks are read and decompressed in 2
                      background threads (``read_ahead_chunks=2``);
  ours 2 threads      the same with ``mode="thread"``: 2 worker threads of this process,
                      each calling ``encode_batch_fast``, which releases the GIL while it
                      encodes; nothing is pickled. The tokenizer's own thread pool is off
                      for both (``TOKENIZERS_PARALLELISM=false``): the library's threads or
                      processes are the parallelism;
  ceiling             two independent per-item infinibatch pipelines, each over every other
                      chunk with half the shuffle buffer and read-ahead, run at the same
                      time in two processes that exchange nothing, for half of the lines
                      each: what two processes reach on this machine (two cores shared with
                      everything else running), measured in the same run.

Throughput is lines/s over the first ``--lines`` lines, wall clock (the batch call uses
both cores: that is the point), median of ``--reps`` interleaved repetitions, with the CPU
time per line of the process and its workers. The batches of every configuration are
checked to be identical, in an untimed pass of each first (hashing the batches costs
about 2 µs a line, which would otherwise count as the pipeline's). Target: the best
batched configuration >= 2x infinibatch; judge it against the ceiling's speed-up.

``--gc-threshold 50000`` gives this process (its worker threads, the in-process
configurations, infinibatch and the ceiling's forked processes alike) the collector
threshold of the library's worker processes.

Run ``python bench/bench_batched.py [--quick] [--gc-threshold N]``; results go to
``bench/results/batched.json``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import _util
from _util import median, print_table, verdict
from bench_background import children_cpu
from corpus import build_corpus, read_chunk

BUFFER_SIZE = 100_000
READ_AHEAD = 10_000
TOKENS_PER_BATCH = 2048
BATCH_CALL = 1000
TASK_LINES = 2000
READ_AHEAD_CHUNKS = 2


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


def pipeline(
    lib: _util.Library,
    chunks: list[str],
    tokenizer: Any,
    batched: str,
    buffer_size: int = BUFFER_SIZE,
    read_ahead: int = READ_AHEAD,
) -> Any:
    parallel = batched in ("processes", "threads")
    reading = {"read_ahead_chunks": READ_AHEAD_CHUNKS} if parallel else {}
    samples = lib.datasets.chunked_dataset_iterator(
        chunks, read_chunk, buffer_size=buffer_size, seed=1, **reading
    )
    if batched:
        call = tokenizer.encode_batch if batched == "batch" else tokenizer.encode_batch_fast

        def encode_batch(lines: list[str]) -> list[list[int]]:
            return [encoding.ids for encoding in call(lines)]

        if batched == "processes":
            tokens = lib.iterators.ParallelMapIterator(
                samples, encode_batch, 2, TASK_LINES, start_method="fork", batched=True
            )
        elif batched == "threads":
            tokens = lib.iterators.ParallelMapIterator(
                samples, encode_batch, 2, TASK_LINES, mode="thread", batched=True
            )
        else:
            tokens = lib.iterators.BatchMapIterator(samples, encode_batch, BATCH_CALL)
    else:

        def encode(line: str) -> list[int]:
            ids: list[int] = tokenizer.encode(line).ids
            return ids

        tokens = lib.iterators.MapIterator(samples, encode)
    return lib.iterators.BucketedReadaheadBatchIterator(
        tokens, read_ahead=read_ahead, key=len, batch_size=batch_size_for, seed=2
    )


LIBRARY_WORKERS = {"ours 2 processes", "ours 2 threads"}
"""The configurations whose worker threads or processes do the parallel work: the
tokenizer's own thread pool is turned off for them (in a forked worker it is off anyway:
set, the variable also spares the warning the tokenizer prints there)."""


@contextmanager
def tokenizer_threads(on: bool) -> Iterator[None]:
    """The tokenizer's batch calls spread over the cores (its default) if `on`, else run
    on the calling thread (``TOKENIZERS_PARALLELISM=false``, which it reads at each call)."""
    before = os.environ.pop("TOKENIZERS_PARALLELISM", None)
    if not on:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
        if before is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def run(make: Callable[[], Any], lines: int) -> tuple[float, float]:
    """(lines/s, CPU µs a line of this process and its children) over the first `lines`
    lines (whole batches)."""
    cpu_before, children_before = time.process_time(), children_cpu()
    start = time.perf_counter()
    it = make()
    seen = 0
    for batch in it:
        seen += len(batch)
        if seen >= lines:
            break
    elapsed = time.perf_counter() - start
    if hasattr(it, "close"):
        it.close()  # reaps the workers, so that their CPU time is counted
    cpu = time.process_time() - cpu_before + children_cpu() - children_before
    return seen / elapsed, cpu / seen * 1e6


def digest(make: Callable[[], Any], lines: int) -> bytes:
    """A digest of the batches over the first `lines` lines (an untimed pass)."""
    hashed = hashlib.blake2b(digest_size=16)
    it = make()
    seen = 0
    for batch in it:
        seen += len(batch)
        hashed.update(repr(batch).encode())
        if seen >= lines:
            break
    if hasattr(it, "close"):
        it.close()
    return hashed.digest()


def _half_infinibatch(chunks: list[str], tokenizer: Any, half: int, lines: int) -> None:
    """Infinibatch's per-item pipeline over every other chunk (from `half`), with half
    the shuffle buffer and read-ahead, consumed for `lines` lines."""
    lib = _util.load_libraries(["infinibatch"])["infinibatch"]
    it = pipeline(lib, chunks[half::2], tokenizer, "", BUFFER_SIZE // 2, READ_AHEAD // 2)
    seen = 0
    for batch in it:
        seen += len(batch)
        if seen >= lines:
            return


def ceiling(chunks: list[str], tokenizer: Any, lines: int) -> float:
    """Lines/s of two independent per-item infinibatch pipelines, each over half of the
    chunks and lines, run at the same time in two processes that exchange nothing: what
    2 processes can do on this machine."""
    context = multiprocessing.get_context("fork")
    start = time.perf_counter()
    processes = [
        context.Process(target=_half_infinibatch, args=(chunks, tokenizer, half, lines // 2))
        for half in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"a ceiling process failed (exit code {process.exitcode})")
    return lines / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument(
        "--gc-threshold", type=int, default=None,
        help="this process's first-generation collector threshold, for every configuration "
        "and the ceiling's processes (default: Python's, 700)",
    )
    args = parser.parse_args()
    if args.gc_threshold is not None:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
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
    configs["ours 2 threads"] = lambda: pipeline(ours, chunks, tokenizer, "threads")
    judged = [name for name in configs if name.startswith("ours") and name != "ours per item"]
    digests = {}
    for name, make in configs.items():
        with tokenizer_threads(name not in LIBRARY_WORKERS):
            digests[name] = digest(make, lines)
    same = len(set(digests.values())) == 1
    rates: dict[str, list[float]] = {name: [] for name in configs}
    cpus: dict[str, list[float]] = {name: [] for name in configs}
    ceilings: list[float] = []
    run(configs["ours batched"], 2000)  # warm-up: the tokenizer's thread pool
    for _ in range(reps):
        for name, make in configs.items():
            with tokenizer_threads(name not in LIBRARY_WORKERS):
                rate, cpu = run(make, lines)
            rates[name].append(rate)
            cpus[name].append(cpu)
        if "infinibatch" in libs:
            with tokenizer_threads(False):  # per-item calls, in forked processes
                ceilings.append(ceiling(chunks, tokenizer, lines))
    base = median(rates["infinibatch"]) if "infinibatch" in rates else None
    rows = []
    for name, got in rates.items():
        rate = median(got)
        x = rate / base if base else None
        rows.append(
            [name, f"{rate:,.0f}", f"{median(cpus[name]):.1f}", "n/a" if x is None else f"{x:.2f}"]
        )
    ceiling_x = median(ceilings) / base if base and ceilings else None
    if ceiling_x is not None:
        rows.append(
            ["ceiling: 2 infinibatch halves at once", f"{median(ceilings):,.0f}", "",
             f"{ceiling_x:.2f}"]
        )
    best = max(judged, key=lambda name: median(rates[name]))
    batched_x = median(rates[best]) / base if base else None
    print_table(
        f"lines/s over the first {lines:,} lines (BPE trained in {trained_s:.1f} s)",
        ["configuration", "lines/s", "CPU µs/line", "x infinibatch"],
        rows,
    )
    print(f"same batches in every configuration: {same}")
    print(f"target batched >= 2x infinibatch ({best}): {verdict(batched_x, 2.0, True)}")
    if ceiling_x is not None:
        print(
            f"this machine's 2-process ceiling, same run: {ceiling_x:.2f}x infinibatch "
            f"(the best batched configuration reaches {batched_x / ceiling_x:.2f} of it)"
        )
    print(f"load average during the run: {os.getloadavg()}")
    _util.write_result(
        "batched" + ("-quick" if args.quick else ""),
        {
            "lines": lines,
            "gc_threshold": gc.get_threshold()[0],
            "rates": rates,
            "cpu_us_per_line": cpus,
            "ceiling_rates": ceilings,
            "same_batches": same,
            "summary": {
                "best_batched": best,
                "batched_x_infinibatch": batched_x,
                "ceiling_x_infinibatch": ceiling_x,
            },
            "load_average": os.getloadavg(),
        },
    )

if __name__ == "__main__":
    main()
