"""What a fan-out consumer process costs per item, the pipeline aside.

``python bench/bench_fanout_transport.py [--items N] [--consumers K] [--kib KIB]
[--prefetch P] [--reps R]``

The upstream is a list of int32 arrays of ``--kib`` KiB (8 by default: pickled with
their reply; from 64 KiB on, through shared-memory segments), which costs nothing to
read, so what is measured is the fan-out itself: the owner's CPU (this process: its
serving thread, reading the upstream included) per item and consumer, and each consumer
process's CPU per item (its loop only). K consumer processes, forked, each take every
item (replicate mode), ``prefetch`` P at a time, ``max_lag`` 2P.

Two transports for the replies, in the same run: the ring of shared memory that every
consumer maps (the default), and the consumers' sockets (the ring switched off, as for a
consumer that cannot map it).
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
from _util import median, print_table, write_result

from infinibatch_like import FanOut, attach
from infinibatch_like.background import fanout_server
from infinibatch_like.iterators import NativeCheckpointableIterator


def consume(address: str, index: int, items: int, prefetch: int, results: Any) -> None:
    gc.freeze()  # collections skip what fork inherited (the items' list)
    consumer = attach(address, index, timeout=60, prefetch=prefetch)
    started = time.process_time()
    for _ in range(items):
        next(consumer)
    spent = time.process_time() - started
    consumer.close()
    results.send(spent)
    results.close()


def run(arrays: list[Any], consumers: int, prefetch: int) -> tuple[float, float]:
    """(owner CPU s, consumer processes' CPU s) for `consumers` processes reading every
    item of `arrays`."""
    context = multiprocessing.get_context("fork")
    gc.collect()
    upstream = NativeCheckpointableIterator(arrays)
    with tempfile.TemporaryDirectory() as tmp, FanOut(
        upstream, consumers, max_lag=2 * prefetch
    ) as fan:
        address = fan.serve(os.path.join(tmp, "fan.sock"))
        pipes = [context.Pipe(duplex=False) for _ in range(consumers)]
        processes = [
            context.Process(target=consume, args=(address, i, len(arrays), prefetch, pipes[i][1]))
            for i in range(consumers)
        ]
        started = time.process_time()
        for process in processes:
            process.start()
        spent = [reader.recv() for reader, _ in pipes]
        owner = time.process_time() - started
        for process in processes:
            process.join()
    return owner, sum(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=6000)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--kib", type=int, default=8, help="each item's array, in KiB")
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    words = args.kib * 256
    arrays = [np.full(words, i, dtype=np.int32) for i in range(args.items)]
    with_ring = fanout_server._ring
    transports = {"ring": with_ring, "sockets": lambda prefix: None}
    owner: dict[str, list[float]] = {name: [] for name in transports}
    consumer: dict[str, list[float]] = {name: [] for name in transports}
    for _ in range(args.reps):  # the transports alternate: no drift favours one
        for name, ring in transports.items():
            fanout_server._ring = ring
            spent_owner, spent_consumers = run(arrays, args.consumers, args.prefetch)
            owner[name].append(spent_owner)
            consumer[name].append(spent_consumers)
    fanout_server._ring = with_ring
    per = args.items * args.consumers / 1e6  # consumer-items, in millions: µs per one
    rows = [
        [name, median(owner[name]) / per, median(consumer[name]) / per]
        for name in transports
    ]
    print_table(
        f"{args.consumers} consumer processes, {args.items} arrays of {args.kib} KiB, "
        f"prefetch={args.prefetch}: CPU µs per item and consumer (median of {args.reps})",
        ["replies through", "owner", "consumer"],
        rows,
    )
    write_result(
        f"fanout-transport-{args.kib}kib-prefetch{args.prefetch}",
        {"arguments": vars(args), "owner": owner, "consumer": consumer},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
