"""Shuffled indices for map-style data: PermutationSourceIterator against shuffled lists.

One epoch of `n` indices in a random order, four ways, measured side by side in one run
(interleaved repetitions, best CPU time):

- ``PermutationSourceIterator(n)``: the Feistel bijection, index by index (O(1) memory);
- ``IndexPermutation`` called directly: the bijection without the iterator;
- ``random.Random(seed).shuffle(list(range(n)))`` and iterating the list (O(n) memory);
- ``InfinitePermutationSourceIterator(list(range(n)))``: this library's list-shuffling
  source (also O(n) memory).

Reported: indices per second, the memory an epoch needs (tracemalloc peak while starting
an epoch and taking its first index) and the latency of a restore to the middle of an
epoch (a fresh iterator, ``setstate``, the first index).

Run ``python bench/bench_permutation.py [--quick] [--items N]``; results go to
``bench/results/permutation.json``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from _util import Samples, Stopwatch, print_table, ratio, write_result

from infinibatch_like.iterators import InfinitePermutationSourceIterator, PermutationSourceIterator
from infinibatch_like.stages.permutation import IndexPermutation, epoch_key

SEED = 1


def shuffled_list(n: int) -> Iterator[int]:
    order = list(range(n))
    random.Random(SEED).shuffle(order)
    return iter(order)


def configurations(n: int) -> dict[str, Callable[[], Iterator[Any]]]:
    return {
        "PermutationSourceIterator": lambda: PermutationSourceIterator(n, seed=SEED),
        "IndexPermutation (bijection only)": lambda: map(
            IndexPermutation(n, epoch_key(SEED, 0)), range(n)
        ),
        "random.shuffle(list(range(n)))": lambda: shuffled_list(n),
        "InfinitePermutationSourceIterator(list)": lambda: InfinitePermutationSourceIterator(
            list(range(n)), seed=SEED
        ),
    }


def epoch_memory(build: Callable[[], Iterator[Any]]) -> int:
    """Peak bytes allocated while starting an epoch and taking its first index."""
    tracemalloc.start()
    try:
        iterator = build()
        next(iterator)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def restore_seconds(factory: Callable[[], Any], n: int) -> float:
    """Wall seconds for a fresh iterator to restore a mid-epoch state and yield once."""
    source = factory()
    for _ in itertools.islice(source, n // 2):
        pass
    state = source.getstate()
    watch = Stopwatch()
    fresh = factory()
    fresh.setstate(state)
    next(fresh)
    return watch.read()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer indices and repeats")
    parser.add_argument("--items", type=int, default=None, help="indices per epoch")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    n = args.items or (200_000 if args.quick else 1_000_000)
    reps = args.reps or (3 if args.quick else 5)
    builds = configurations(n)
    samples = {name: Samples() for name in builds}
    for _ in range(reps):  # interleaved repetitions
        for name, build in builds.items():
            watch = Stopwatch()
            for _ in itertools.islice(build(), n):
                pass
            samples[name].add(watch.read())
    memory = {name: epoch_memory(build) for name, build in builds.items()}
    restores = {
        "PermutationSourceIterator": restore_seconds(
            lambda: PermutationSourceIterator(n, seed=SEED), n
        ),
        "InfinitePermutationSourceIterator(list)": restore_seconds(
            lambda: InfinitePermutationSourceIterator(list(range(n)), seed=SEED), n
        ),
    }
    best = {name: min(s.cpu) for name, s in samples.items()}
    reference = best["random.shuffle(list(range(n)))"]
    rows = [
        [
            name,
            n / best[name],
            ratio(reference, best[name]),
            memory[name] / 1e6,
            None if name not in restores else restores[name] * 1e3,
        ]
        for name in builds
    ]
    print_table(
        f"one epoch of {n:,} shuffled indices (best CPU time of {reps})",
        ["configuration", "indices/s", "speed vs shuffle", "epoch MB", "restore ms"],
        rows,
    )
    write_result(
        "permutation_quick" if args.quick else "permutation",
        {
            "items": n,
            "reps": reps,
            "samples": {name: s.summary() for name, s in samples.items()},
            "indices_per_second": {name: n / best[name] for name in builds},
            "epoch_peak_bytes": memory,
            "restore_seconds": restores,
        },
    )


if __name__ == "__main__":
    main()
