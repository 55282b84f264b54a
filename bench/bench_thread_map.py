"""ParallelMapIterator(mode="thread") with a transform that releases the GIL.

zlib-decompressing large blocks (zlib releases the GIL while it works): a thread
ParallelMapIterator against MapIterator (one thread) and a process ParallelMapIterator
with the same number of workers, measured side by side in one run. The ratio
MapIterator / thread pool is the overlap the threads achieve (up to the number of cores).

Run ``python bench/bench_thread_map.py [--quick]``; results go to
``bench/results/thread_map.json``.
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Callable
from typing import Any

from _util import Samples, Stopwatch, print_table, ratio, write_result

import infinibatch_like.iterators as ours

WORKERS = 2


def decompressed_size(block: bytes) -> int:
    return len(zlib.decompress(block))


def blocks(count: int, size: int) -> list[bytes]:
    return [
        zlib.compress(bytes(range(256)) * (size // 256) + bytes([i % 256])) for i in range(count)
    ]


def configurations(data: list[bytes]) -> dict[str, Callable[[], Any]]:
    def source() -> ours.NativeCheckpointableIterator:
        return ours.NativeCheckpointableIterator(data)

    return {
        "MapIterator": lambda: ours.MapIterator(source(), decompressed_size),
        "thread pool": lambda: ours.ParallelMapIterator(
            source(), decompressed_size, WORKERS, 1, mode="thread"
        ),
        "process pool": lambda: ours.ParallelMapIterator(source(), decompressed_size, WORKERS, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    count, size = (40, 4 << 20) if args.quick else (100, 8 << 20)
    reps = args.reps or (3 if args.quick else 5)
    data = blocks(count, size)
    samples = {name: Samples() for name in configurations(data)}
    for _ in range(reps):  # interleaved repetitions
        for name, build in configurations(data).items():
            with build() as pipeline:
                watch = Stopwatch()
                for _ in pipeline:
                    pass
                samples[name].add(watch.read())
    walls = {name: min(s.wall) for name, s in samples.items()}
    rows = [[name, walls[name] * 1e3, ratio(walls["MapIterator"], walls[name])] for name in walls]
    print_table(
        f"zlib.decompress of {count} blocks of {size >> 20} MiB, {WORKERS} workers "
        f"(best of {reps})",
        ["configuration", "wall ms", "speed-up vs MapIterator"],
        rows,
    )
    write_result(
        "thread_map_quick" if args.quick else "thread_map",
        {
            "count": count,
            "block_bytes": size,
            "workers": WORKERS,
            "samples": {name: s.summary() for name, s in samples.items()},
        },
    )


if __name__ == "__main__":
    main()
