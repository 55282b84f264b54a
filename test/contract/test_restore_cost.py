"""Each stage re-reads on restore only what its documentation says it does."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from _counting import Counter

import infinibatch_like.iterators as it
from infinibatch_like._core.protocol import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import SkippableIterator
from infinibatch_like.stages.bad_records import SkipPolicy


def counted(n: int, counter: Counter) -> it.MapIterator:
    return it.MapIterator(it.NativeCheckpointableIterator(list(range(n))), counter)


def items_read_to_restore(
    build: Callable[[Counter], it.CheckpointableIterator[Any]], position: int
) -> int:
    """Upstream items read by a fresh pipeline to restore at `position` and yield one item."""
    original = build(Counter())
    list(itertools.islice(original, position))
    state = json.loads(json.dumps(original.getstate()))
    counter = Counter()
    fresh = build(counter)
    fresh.setstate(state)
    next(fresh)
    return counter.calls


@pytest.mark.parametrize(
    ("build", "position", "bound"),
    [
        # Map and FixedBatch re-read nothing: the one item or batch yielded is all.
        (lambda c: it.MapIterator(counted(10_000, c), str), 5_000, 1),
        (lambda c: it.FixedBatchIterator(counted(10_000, c), 7), 500, 7),
        # Blockwise: one block (plus the item yielded, which lies in it).
        (lambda c: it.BlockwiseShuffleIterator(counted(10_000, c), 100, 1), 5_050, 100),
        # Buffered: the buffer is in the state; only the next item is read.
        (lambda c: it.BufferedShuffleIterator(counted(10_000, c), 100, 1), 5_050, 1),
        # Bucketed: one read-ahead window.
        (lambda c: it.BucketedReadaheadBatchIterator(counted(10_000, c), 50, None, 5, seed=1),
         700, 50),
        # Windowed: at most 2 * max(width, 64) items, plus the next one.
        (lambda c: it.WindowedIterator(counted(10_000, c), 3), 5_000, 2 * 64 + 1),
        (lambda c: it.WindowedIterator(counted(10_000, c), 100), 5_000, 2 * 100 + 1),
    ],
)
def test_restore_rereads_at_most(build: Any, position: int, bound: int) -> None:
    assert items_read_to_restore(build, position) <= bound


def test_select_many_rereads_one_collection() -> None:
    reads: list[int] = []

    def read_chunk(index: int) -> list[int]:
        reads.append(index)
        return list(range(index * 10, index * 10 + 10))

    def build() -> it.CheckpointableIterator[Any]:
        return chunked_dataset_iterator(list(range(50)), read_chunk, buffer_size=1, train=False,
                                        shuffle=False)

    original = build()
    list(itertools.islice(original, 255))
    state = original.getstate()
    reads.clear()
    fresh = build()
    fresh.setstate(state)
    assert next(fresh) == 255
    assert reads == [25]



class _CountingChunk(SkippableIterator[int]):
    """Items 0..n-1 of a chunk; counts the items produced by next() and skipped by skip()."""

    made = 0
    skipped = 0

    def __init__(self, n: int) -> None:
        self._next, self._n = 0, n

    def __next__(self) -> int:
        if self._next >= self._n:
            raise StopIteration
        _CountingChunk.made += 1
        self._next += 1
        return self._next - 1

    def skip(self, count: int) -> int:
        skipped = min(count, self._n - self._next)
        _CountingChunk.skipped += skipped
        self._next += skipped
        return skipped


@pytest.mark.parametrize("on_error", ["raise", SkipPolicy(max_skips=2)])
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_restore_inside_a_skippable_chunk_skips_rather_than_produces(
    on_error: Any, read_ahead: int
) -> None:
    def build() -> it.CheckpointableIterator[int]:
        return it.SelectManyIterator(
            it.NativeCheckpointableIterator([1000, 1000, 1000]),
            _CountingChunk,
            read_ahead=read_ahead,
            on_error=on_error,
        )

    original = build()
    expected = list(itertools.islice(original, 2500))
    state = original.getstate()
    _CountingChunk.made = _CountingChunk.skipped = 0
    fresh = build()
    fresh.setstate(state)
    assert next(fresh) == 500
    assert expected[-1] == 499
    assert _CountingChunk.skipped == 500
    if read_ahead == 0:  # read-ahead reads the rest of the chunks in threads
        assert _CountingChunk.made == 1
    too_far = dict(state, consumed=1001)
    refused = build()
    refused.setstate(too_far)
    with pytest.raises(StateMismatchError, match="skips 1001 items of the current collection, "
                       "but there are only 1000"):
        next(refused)
