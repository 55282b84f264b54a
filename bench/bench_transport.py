"""The shared-memory transport of worker processes: numpy batches through a process
`PrefetchIterator`, with the transport and without it (every array pickled through the
pipe), and plain pickle over a `multiprocessing.Pipe`, in one run.

(a) the consumer's cost of one 1 MiB batch in a steady flow: batches of 8 distinct
    arrays in turn (each batch of a message its own segment); after 200 batches, the
    worker is given a second to fill the buffer and the consumer takes what waits,
    twice (the worker's segments are all mapped by then, as in any run past its first
    batches: the first time its pool grows to what a full buffer needs, and the
    consumer maps each new segment once); then the worker is given a second again. The
    first ``next()`` after that second is timed apart (it pays for what the idle second
    left cold, e.g. the caches: about 100 us on a loaded machine, as much as a plain
    ``pickle.loads`` of a small message pays then); then ``next()`` is timed over the
    48 batches waiting, each dropped at once (the mean: a message of several batches is
    decoded by one call); target <= 10 us. The mean with the first call included is
    printed too;
(b) the flow of 8 MiB batches (batches/s, the consumer dropping each batch): transport,
    no transport, and ``Connection.send``/``recv`` of the array; target: transport >= 3x
    pickle over a pipe;
(c) the same flow for small arrays (4 KiB to 1 MiB), transport on and off: where the
    transport starts to pay (its `THRESHOLD`).

Run ``python bench/bench_transport.py [--quick]`` (fork start method; Linux); results go to
``bench/results/transport.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

import _util
import numpy as np
from _util import median, print_table, verdict

from infinibatch_like.background import shm
from infinibatch_like.iterators import NativeCheckpointableIterator, PrefetchIterator

MIB = 1 << 20
WARM_UP = 200
TIMED = 48
"""Batches timed after the idle second (below the worker's 64 segments)."""


def _prefetcher(items: list[np.ndarray], buffer: int, transport: bool) -> Any:
    shm.ENABLED = transport  # read by the worker (forked) when it starts
    try:
        it = PrefetchIterator(NativeCheckpointableIterator(items), buffer, start_method="fork")
        next(it)  # the worker is up
    finally:
        shm.ENABLED = True
    return it


def consumer_cost(transport: bool, timed: int) -> tuple[float, float, float]:
    """Seconds of ``next()`` for a 1 MiB batch that waits in the buffer: the first call
    after the idle second, the mean of the `timed` calls after it, and the mean of all."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, MIB, dtype=np.uint8) for _ in range(8)]
    items = [arrays[i % len(arrays)] for i in range(WARM_UP + 3 * (timed + 1) + 8)]
    it = _prefetcher(items, timed + 4, transport)
    for i in range(WARM_UP):
        assert int(next(it)[-1]) == int(items[i + 1][-1])
    for _ in range(2):  # the first time, the consumer maps the segments the worker added
        time.sleep(1.0)  # the worker fills the buffer
        for _ in range(timed + 1):
            next(it)
    time.sleep(1.0)
    start = time.perf_counter()
    next(it)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(timed):
        next(it)
    steady = (time.perf_counter() - start) / timed
    it.close()
    return first, steady, (first + steady * timed) / (timed + 1)


def flow(size: int, count: int, transport: bool) -> float:
    """Batches per second of `size` bytes through a process PrefetchIterator."""
    it = _prefetcher([np.ones(size, np.uint8)] * (count + 1), 8, transport)
    start = time.perf_counter()
    for batch in it:
        del batch
    elapsed = time.perf_counter() - start
    it.close()
    return count / elapsed


def _send(connection: Any, size: int, count: int) -> None:
    array = np.ones(size, np.uint8)
    for _ in range(count):
        connection.send(array)
    connection.close()


def pipe_flow(size: int, count: int) -> float:
    """Batches per second of `size` bytes pickled over a multiprocessing Pipe."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_send, args=(sender, size, count + 1))
    process.start()
    sender.close()
    receiver.recv()
    start = time.perf_counter()
    for _ in range(count):
        receiver.recv()
    elapsed = time.perf_counter() - start
    process.join()
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    reps = 2 if args.quick else args.reps
    count = 40 if args.quick else 150

    cost: dict[str, list[float]] = {"transport": [], "pickle": []}
    first: dict[str, list[float]] = {"transport": [], "pickle": []}
    overall: dict[str, list[float]] = {"transport": [], "pickle": []}
    rates: dict[str, list[float]] = {"transport": [], "no transport": [], "pipe": []}
    small: dict[int, dict[str, list[float]]] = {
        size: {"transport": [], "pickle": []} for size in (4096, 16384, 65536, 262144, MIB)
    }
    for _ in range(reps):  # interleaved
        for path, transport in (("transport", True), ("pickle", False)):
            after_idle, steady, mean = consumer_cost(transport, TIMED)
            first[path].append(after_idle)
            cost[path].append(steady)
            overall[path].append(mean)
        rates["transport"].append(flow(8 * MIB, count, True))
        rates["no transport"].append(flow(8 * MIB, count, False))
        rates["pipe"].append(pipe_flow(8 * MIB, count))
        for size, got in small.items():
            n = max(200, min(5000, 200 * MIB // size // 8))
            got["transport"].append(flow(size, n, True))
            got["pickle"].append(flow(size, n, False))

    c_shm, c_pickle = median(cost["transport"]), median(cost["pickle"])
    print_table(
        "(a) consumer cost of a 1 MiB batch (mean next() in a steady flow; the first call "
        "after the idle second apart)",
        ["path", "us", "first after idle us", "mean with it us", "target"],
        [
            [
                "transport",
                f"{c_shm * 1e6:.1f}",
                f"{median(first['transport']) * 1e6:.0f}",
                f"{median(overall['transport']) * 1e6:.1f}",
                verdict(10e-6 / c_shm, 1.0, True),
            ],
            [
                "pickle through the pipe",
                f"{c_pickle * 1e6:.1f}",
                f"{median(first['pickle']) * 1e6:.0f}",
                f"{median(overall['pickle']) * 1e6:.1f}",
                "",
            ],
        ],
    )
    r = {k: median(v) for k, v in rates.items()}
    print_table(
        "(b) 8 MiB batches per second",
        ["path", "batches/s", "x pipe", "target"],
        [
            ["transport", f"{r['transport']:.0f}", f"{r['transport'] / r['pipe']:.2f}",
             verdict(r["transport"] / r["pipe"], 3.0, True)],
            ["no transport (pickled)", f"{r['no transport']:.0f}",
             f"{r['no transport'] / r['pipe']:.2f}", ""],
            ["Connection.send/recv", f"{r['pipe']:.0f}", "1.00", ""],
        ],
    )
    rows = []
    summary_small = {}
    for size, got in small.items():
        on, off = median(got["transport"]), median(got["pickle"])
        summary_small[size] = on / off
        rows.append([f"{size // 1024} KiB", f"{on:.0f}", f"{off:.0f}", f"{on / off:.2f}"])
    print_table("(c) batches per second by size", ["size", "transport", "pickle", "ratio"], rows)
    _util.write_result(
        "transport" + ("-quick" if args.quick else ""),
        {
            "consumer_cost_s": cost,
            "first_after_idle_s": first,
            "mean_with_first_s": overall,
            "rates_8mib": rates,
            "small": {str(k): v for k, v in small.items()},
            "summary": {
                "consumer_cost_us": c_shm * 1e6,
                "first_after_idle_us": median(first["transport"]) * 1e6,
                "mean_with_first_us": median(overall["transport"]) * 1e6,
                "pickle_consumer_cost_us": c_pickle * 1e6,
                "x_pipe_8mib": r["transport"] / r["pipe"],
                "x_no_transport_8mib": r["transport"] / r["no transport"],
                "small_ratio": {str(k): v for k, v in summary_small.items()},
            },
            "threshold": shm.THRESHOLD,
        },
    )


if __name__ == "__main__":
    main()
