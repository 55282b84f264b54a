"""Fan-out: what it costs several consumers to read one pipeline, against each its own.

``python bench/bench_fanout.py [--quick] [--batches N] [--consumers K] [--start-method M]
[--tokenizer {whitespace,bpe}] [--format {tokens,arrays}] [--min-kib KIB]
[--shared-arrays] [--prefetch P]``

The pipeline is P1 of ``bench_pipeline.py`` (chunked gzip text, shuffle buffer,
tokenized, bucketed batches of about 2048 tokens) over the bench corpus; with
``--tokenizer bpe``, the P1 variant of ``bench_batched.py`` whose tokenizer is a real
one (a BPE of the ``tokenizers`` package trained at start-up on the corpus, called once
per 1,000 lines with ``encode_batch_fast`` on this thread), whose batches are lists of
token ids. Every scenario consumes N batches per consumer, each batch dropped once
taken, as a training loop that hands it to its model does; the CPU time counted is this
process's, plus its children's (the loops of consumer processes, started with forkserver
unless ``--start-method`` says otherwise, shown apart) where there are some:

- ``one pipeline``: one consumer, one pipeline (the unit of the ratios);
- ``K independent pipelines``: what K consumers cost without a fan-out (about K x);
- ``FanOut replicate, K threads``: one pipeline, K consumers reading it from threads;
- ``FanOut replicate, K processes``: one pipeline in this process, K consumer processes
  attached by a Unix socket (every batch pickled once into a ring of shared memory that
  each reads in place, unpickled by each, its arrays of 64 KiB or more put once into
  shared memory that each maps; up to ``--prefetch`` batches a round trip, 32 by default);
- ``FanOut split, 2 processes``: 2 consumer processes share the first 2N batches.

Checks, on one more run of each scenario whose consumers digest every batch (not timed):
every replicate consumer's batches are the single pipeline's first N batches
(by digest); the split consumers' batches are its first 2N batches, each exactly once,
batch k to consumer k % 2. Target: K=4 replicate costs <= 1.25x the CPU of one pipeline.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import _util
import bench_batched
import bench_pipeline
import numpy as np
from _util import median, print_table, ratio, verdict, write_result
from bench_pipeline import make_pipeline
from corpus import build_corpus

from infinibatch_like import FanOut, attach, shared_zeros

TARGET = 1.25


def as_array(batch: list[list[Any]]) -> Any:
    """A batch as a model takes it: a padded int32 array of its token ids (P1's own
    tokens, strings, stand for the id of their length), padded to at least ``--min-kib``
    KiB."""
    width = max(len(line) for line in batch)
    width = max(width, -(-_min_bytes[0] // (4 * len(batch))))
    zeros = shared_zeros if _shared[0] else np.zeros
    array = zeros((len(batch), width), dtype=np.int32)
    for row, line in enumerate(batch):
        array[row, : len(line)] = [len(token) for token in line] if _strings(line) else line
    return array


def _strings(line: list[Any]) -> bool:
    return bool(line) and isinstance(line[0], str)


FORMATS = ("tokens", "arrays")
_format = ["tokens"]
_min_bytes = [0]
_shared = [False]
"""Whether arrays are made in shared memory (`shared_zeros`), whatever the scenario."""
_tokenizer: list[Any] = [None]
"""The BPE tokenizer of ``--tokenizer bpe`` (None: P1's whitespace split)."""
_prefetch = [32]
"""Items a consumer process receives per round trip to the owner, at most (``max_lag`` is
twice as many, so that a consumer does not wait for the others to take its last answer)."""


def pipeline(lib: _util.Library, chunks: list[str]) -> Any:
    """P1 (or its BPE variant), whose batches are token lists, or arrays with ``--format
    arrays``."""
    if _tokenizer[0] is None:
        batches = make_pipeline(lib, chunks)
    else:
        batches = bench_batched.pipeline(lib, chunks, _tokenizer[0], "fast")
    if _format[0] == "arrays":
        return lib.iterators.MapIterator(batches, as_array)
    return batches


def batch_digest(batch: Any) -> bytes:
    if isinstance(batch, np.ndarray):
        return hashlib.blake2b(batch.tobytes(), digest_size=16).digest()
    if not _strings(batch[0]):  # token ids
        return hashlib.blake2b(repr(batch).encode(), digest_size=16).digest()
    return bench_pipeline.batch_digest(batch)


Run = tuple[list[list[bytes]], float]
"""What a scenario returns: each consumer's digests (on a checking run), and the CPU
seconds its consumer processes spent taking their batches."""

_checking = [False]
"""Whether the consumers digest their batches (a run for the checks, not timed)."""


def measure(action: Callable[[], Run]) -> tuple[float, float, float]:
    """(CPU s, wall s, CPU s of the consumer processes) of `action`: the CPU of this
    process and of the consumer processes' loops (their start-up not counted)."""
    gc.collect()  # what an earlier scenario left is not this one's cost
    cpu, wall = time.process_time(), time.perf_counter()
    _, children = action()
    return time.process_time() - cpu + children, time.perf_counter() - wall, children


def checked(action: Callable[[], Run]) -> list[list[bytes]]:
    """Each consumer's digests of its batches, on a run of `action` whose consumers
    digest them."""
    _checking[0] = True
    try:
        return action()[0]
    finally:
        _checking[0] = False


def take(iterator: Any, batches: int) -> list[bytes]:
    """The next `batches` batches, each dropped once taken (its digest kept on a
    checking run)."""
    if _checking[0]:
        return [batch_digest(next(iterator)) for _ in range(batches)]
    for _ in range(batches):
        next(iterator)
    return []


def one_pipeline(lib: _util.Library, chunks: list[str], batches: int) -> Run:
    single = pipeline(lib, chunks)
    digests = take(single, batches)
    single.close()
    return [digests], 0.0


def independent(lib: _util.Library, chunks: list[str], batches: int, consumers: int) -> Run:
    return [one_pipeline(lib, chunks, batches)[0][0] for _ in range(consumers)], 0.0


def fan_out_threads(lib: _util.Library, chunks: list[str], batches: int, consumers: int) -> Run:
    with FanOut(pipeline(lib, chunks), consumers, max_lag=2 * _prefetch[0]) as fan:
        readers = [fan.consumer(i) for i in range(consumers)]
        out: list[list[bytes]] = [[]] * consumers

        def read(i: int) -> None:
            out[i] = take(readers[i], batches)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(consumers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return out, 0.0


def consumer_process(
    address: str, index: int, batches: int, checking: bool, prefetch: int, results: Any
) -> None:
    gc.freeze()  # as the library's own workers do: collections skip what fork inherited
    consumer = attach(address, index, timeout=60, prefetch=prefetch)
    cpu = time.process_time()
    _checking[0] = checking  # not inherited under spawn and forkserver
    digests = take(consumer, batches)
    cpu = time.process_time() - cpu
    consumer.close()
    results.send((digests, cpu))
    results.close()


def fan_out_processes(
    lib: _util.Library,
    chunks: list[str],
    batches: int,
    consumers: int,
    mode: str,
    method: str,
) -> Run:
    context = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory() as tmp, FanOut(
        pipeline(lib, chunks), consumers, mode=mode, max_lag=2 * _prefetch[0]
    ) as fan:
        address = fan.serve(os.path.join(tmp, "fan.sock"))
        pipes = [context.Pipe(duplex=False) for _ in range(consumers)]
        processes = [
            context.Process(
                target=consumer_process,
                args=(address, i, batches, _checking[0], _prefetch[0], pipes[i][1]),
            )
            for i in range(consumers)
        ]
        for process in processes:
            process.start()
        results = [reader.recv() for reader, _ in pipes]
        for process in processes:
            process.join()
    return [digests for digests, _ in results], sum(cpu for _, cpu in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus and run")
    parser.add_argument("--batches", type=int, default=None, help="batches per consumer")
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--tokenizer",
        choices=("whitespace", "bpe"),
        default="whitespace",
        help="P1's whitespace split, or a BPE of the tokenizers package trained at start-up "
        "(the P1 variant of bench_batched.py: batches of token ids)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="tokens",
        help="batches as token lists (P1's own) or as padded int32 arrays (what a model "
        "takes; they cross a process boundary at the cost of a copy)",
    )
    parser.add_argument(
        "--min-kib",
        type=int,
        default=0,
        help="with --format arrays: pad each array to at least this many KiB (from 64 KiB "
        "on, consumer processes map it from shared memory instead of unpickling a copy)",
    )
    parser.add_argument(
        "--shared-arrays",
        action="store_true",
        help="with --format arrays: make them with shared_zeros (in shared memory, which "
        "consumer processes map without a copy) instead of numpy.zeros, in every scenario",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=32,
        help="batches a consumer process receives per round trip, at most (max_lag: twice)",
    )
    parser.add_argument(
        "--start-method",
        default="forkserver",
        choices=multiprocessing.get_all_start_methods(),
        help="how consumer processes start: forkserver by default, processes that do not "
        "share the owner's pages (as ranks torchrun starts, or an evaluator started on its "
        "own; Python 3.14's default); after fork, the owner's pages are copied as it "
        "writes them",
    )
    args = parser.parse_args(argv)
    _format[0], _min_bytes[0], _prefetch[0] = args.format, 1024 * args.min_kib, args.prefetch
    _shared[0] = args.shared_arrays
    lines = 200_000 if args.quick else 1_000_000
    batches = args.batches or (300 if args.quick else 1500)
    k, method = args.consumers, args.start_method
    chunks = build_corpus(lines)
    if args.tokenizer == "bpe":
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # its calls on this thread alone
        _tokenizer[0] = bench_batched.train_tokenizer(chunks[:2], 8000)
    lib = _util.load_libraries(["infinibatch_like"])["infinibatch_like"]
    print(
        f"P1 ({args.tokenizer} tokenizer) over {lines:,} lines, batches as {args.format}"
        + (f" of at least {args.min_kib} KiB" if args.min_kib else "")
        + f"; {batches} batches per "
        f"consumer; {k} consumers; consumer "
        f"processes started with {method!r}, prefetch={args.prefetch}, "
        f"max_lag={2 * args.prefetch}; {args.reps} repeats (median CPU)",
        flush=True,
    )
    scenarios: dict[str, Callable[[], Run]] = {
        "one pipeline": lambda: one_pipeline(lib, chunks, batches),
        f"{k} independent pipelines": lambda: independent(lib, chunks, batches, k),
        f"FanOut replicate, {k} threads": lambda: fan_out_threads(lib, chunks, batches, k),
        f"FanOut replicate, {k} processes": lambda: fan_out_processes(
            lib, chunks, batches, k, "replicate", method
        ),
        "FanOut split, 2 processes": lambda: fan_out_processes(
            lib, chunks, batches, 2, "split", method
        ),
    }
    cpu: dict[str, list[float]] = {name: [] for name in scenarios}
    wall: dict[str, list[float]] = {name: [] for name in scenarios}
    consumers: dict[str, list[float]] = {name: [] for name in scenarios}
    for rep in range(args.reps):  # each repeat in another order: no scenario always first
        names = list(scenarios)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            spent, elapsed, in_consumers = measure(scenarios[name])
            cpu[name].append(spent)
            wall[name].append(elapsed)
            consumers[name].append(in_consumers)
    digests = {name: checked(action) for name, action in scenarios.items()}
    reference = checked(lambda: one_pipeline(lib, chunks, 2 * batches))[0]
    exact = {
        name: all(got == reference[:batches] for got in digests[name])
        for name in scenarios
        if "split" not in name
    }
    split = digests["FanOut split, 2 processes"]
    exact["FanOut split, 2 processes"] = (
        sorted(split[0] + split[1]) == sorted(reference)
        and split[0] == reference[0::2]
        and split[1] == reference[1::2]
    )
    unit = median(cpu["one pipeline"])
    rows = []
    for name in scenarios:
        per_batch = batches * (2 if "split" in name else 1)
        ratio_cpu = ratio(median(cpu[name]), unit) if "split" not in name else None
        judged = name.startswith("FanOut replicate") and k == 4
        rows.append(
            [
                name,
                median(cpu[name]),
                median(wall[name]),
                ratio_cpu,
                1e3 * median(cpu[name]) / per_batch,
                1e3 * median(consumers[name]) / per_batch if "processes" in name else None,
                exact[name],
                verdict(ratio_cpu, TARGET, higher_is_better=False) if judged else "",
            ]
        )
    print_table(
        f"CPU to consume {batches} batches per consumer (target: {k} replicate <= "
        f"{TARGET}x one pipeline)",
        [
            "scenario",
            "CPU s",
            "wall s",
            "x one",
            "CPU ms/batch",
            "of which consumer processes",
            "exact",
            "target",
        ],
        rows,
    )
    write_result(
        f"fanout-{args.format}"
        + ("-bpe" if args.tokenizer == "bpe" else "")
        + (f"-{args.min_kib}kib" if args.min_kib else "")
        + ("-shared" if args.shared_arrays else "")
        + (f"-prefetch{args.prefetch}" if args.prefetch != 32 else "")
        + ("-quick" if args.quick else ""),
        {
            "arguments": vars(args),
            "lines": lines,
            "cpu": cpu,
            "wall": wall,
            "consumer_processes_cpu": consumers,
            "exact": exact,
            "ratios": {row[0]: row[3] for row in rows},
        },
    )
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
