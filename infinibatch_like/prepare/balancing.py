"""Chunks split into shards of nearly equal item counts, the same on every rank and machine.

A stride (``chunk_refs[shard::num_shards]``) gives each shard every n-th chunk whatever its
size, so shards differ as much as the chunks that fall to them do. `balanced_shards` uses
the chunks' item counts instead (``ChunkIndex.shards`` does it for the chunk tool's index).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TypeVar

from .._core.checks import require_int

T = TypeVar("T")

_OWNER = "balanced_shards"


def balanced_shards(chunks: Iterable[tuple[T, int]], num_shards: int) -> list[list[T]]:
    """The chunks of each of `num_shards` shards, with nearly equal item counts per shard.

    Longest processing time first: the chunks, largest count first (equal counts in their
    order in `chunks`), each go to the shard holding the fewest items so far (ties: the
    shard with the fewest chunks, then the lowest shard number). Only integers are
    compared, so every rank and machine computes the same shards from the same list and no
    communication is needed. Guarantees, for any counts: each chunk is in exactly one
    shard; the item counts of any two shards differ by at most the largest chunk's count
    (in practice far less: many chunks of similar sizes balance to within a few items);
    with at least `num_shards` chunks, no shard is empty. Each shard lists its chunks in
    their order in `chunks` (for a chunk index: stream order).

    Compute the shards once and look them up in the shard factory of a `ShardedIterator`
    (``factory(shard, num_shards)`` -> a pipeline over ``shards[shard]``); `num_shards` and
    the chunk list must stay the same for the whole training, as the shards' checkpoints
    refer to them.

    Args:
        chunks: ``(chunk, count)`` pairs: any chunk reference (a path, a URL, a position)
            with its number of items (or any other non-negative integer weight, e.g. bytes).
        num_shards: the number of shards (>= 1).

    Returns:
        ``num_shards`` lists of chunk references.

    Raises:
        TypeError, ValueError: for a `num_shards` that is not an int >= 1, or an entry of
            `chunks` that is not a ``(chunk, count)`` pair with an int count >= 0 (naming
            its position and value).
    """
    require_int(_OWNER, "num_shards", num_shards, 1)
    entries = [_checked(position, entry) for position, entry in enumerate(chunks)]
    order = sorted(range(len(entries)), key=lambda position: -entries[position][1])
    # (items, chunks, shard) of every shard: the heap's smallest is the next to fill
    loads = [(0, 0, shard) for shard in range(num_shards)]
    owner = [0] * len(entries)
    for position in order:
        items, count, shard = loads[0]
        owner[position] = shard
        heapq.heapreplace(loads, (items + entries[position][1], count + 1, shard))
    shards: list[list[T]] = [[] for _ in range(num_shards)]
    for position, (chunk, _) in enumerate(entries):
        shards[owner[position]].append(chunk)
    return shards


def _checked(position: int, entry: tuple[T, int]) -> tuple[T, int]:
    """`entry` if it is a ``(chunk, count)`` pair (a tuple or a list) with an int count >= 0."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise TypeError(
            f"{_OWNER}: chunks[{position}] must be a (chunk, count) pair, got {entry!r}"
        )
    count = entry[1]
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"{_OWNER}: the count of chunks[{position}] must be an int, got {count!r}")
    if count < 0:
        raise ValueError(f"{_OWNER}: the count of chunks[{position}] must be >= 0, got {count}")
    return entry[0], count
