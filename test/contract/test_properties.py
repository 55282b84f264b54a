"""Property tests of the invariants that single stages promise, whatever their parameters.

Shuffles permute; blocks, windows and batches keep their documented shapes; rank shares
partition the data; states stay small and hold no items; seed=None stages reproduce.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from _profiles import examples
from _streams import ChunkReader, native, take
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like.datasets import chunked_dataset_iterator

FAST = settings(max_examples=examples(2.5),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=examples(0.1),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

seeds = st.one_of(st.integers(0, 2**64), st.sampled_from(["", "seed", "ζ"]))


def as_multiset(items: Sequence[Any]) -> Counter[str]:
    """Items by their repr, so that None, 1, 1.0 and "1" stay apart."""
    return Counter(map(repr, items))


def json_copy(state: Any) -> Any:
    return json.loads(json.dumps(state))


# -- BufferedShuffleIterator ---------------------------------------------------------------


def buffered_shuffle_model(items: Sequence[Any], size: int, seed: Any) -> list[Any]:
    """The documented algorithm, with an explicit marker for empty slots."""
    rng, empty = random.Random(seed), object()
    slots: list[Any] = [empty] * size
    out = []
    for item in items:
        index = rng.randrange(size)
        if slots[index] is not empty:
            out.append(slots[index])
        slots[index] = item
    out.extend(item for item in reversed(slots) if item is not empty)
    return out


@FAST
@given(
    items=st.lists(st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=2)), max_size=80),
    buffer_size=st.integers(1, 12),
    seed=seeds,
)
def test_buffered_shuffle_permutes_and_keeps_none(
    items: list[Any], buffer_size: int, seed: Any
) -> None:
    out = list(it.BufferedShuffleIterator(native(items), buffer_size, seed))
    assert as_multiset(out) == as_multiset(items)
    assert out.count(None) == items.count(None)
    assert out == buffered_shuffle_model(items, buffer_size, seed)


# -- BlockwiseShuffleIterator --------------------------------------------------------------


@FAST
@given(length=st.integers(0, 90), block_size=st.integers(1, 15), seed=seeds)
def test_blockwise_shuffle_permutes_within_blocks(length: int, block_size: int, seed: Any) -> None:
    items = [f"b{i}" for i in range(length)]
    out = list(it.BlockwiseShuffleIterator(native(items), block_size, seed))
    assert sorted(out) == sorted(items)
    rng = random.Random(seed)
    for start in range(0, length, block_size):
        block = items[start : start + block_size]
        assert sorted(out[start : start + block_size]) == sorted(block)
        rng.shuffle(block)
        assert out[start : start + block_size] == block


# -- BucketedReadaheadBatchIterator --------------------------------------------------------


def capacity_from(budget: int) -> Callable[[str], int]:
    def capacity(longest: str) -> int:
        return budget // len(longest)  # 0 when the item is longer than the budget

    return capacity


def boundary_of(item: str) -> int:
    return len(item) % 3


def bucketed_model(
    items: list[str], read_ahead: int, key: Any, batch_size: Any, boundary: Any, shuffle: bool,
    seed: Any,
) -> list[list[str]]:
    """The documented algorithm: sort each window, cut greedily, shuffle the batches."""
    rng = random.Random(seed)
    out: list[list[str]] = []
    for start in range(0, max(len(items), 1), read_ahead):
        window = items[start : start + read_ahead]
        if key is not None:
            window = sorted(window, key=key, reverse=True)
        batches: list[list[str]] = []
        for item in window:
            if batches:
                last = batches[-1]
                limit = batch_size if isinstance(batch_size, int) else batch_size(last[0])
                full = len(last) >= max(1, limit)
                crossed = boundary is not None and boundary(item) != boundary(last[-1])
                if not (full or crossed):
                    last.append(item)
                    continue
            batches.append([item])
        if shuffle:
            rng.shuffle(batches)
        out += batches
    return out


@FAST
@given(
    lengths=st.lists(st.integers(1, 12), max_size=70),
    read_ahead=st.integers(1, 14),
    use_key=st.booleans(),
    batch_size=st.one_of(st.integers(1, 6), st.integers(0, 30).map(capacity_from)),
    use_boundary=st.booleans(),
    shuffle=st.booleans(),
    seed=seeds,
)
def test_bucketed_batches(
    lengths: list[int],
    read_ahead: int,
    use_key: bool,
    batch_size: Any,
    use_boundary: bool,
    shuffle: bool,
    seed: Any,
) -> None:
    # Distinct items whose key is their length; the "#" keeps the length at least 2.
    items = [f"{i}#" + "x" * n for i, n in enumerate(lengths)]
    key = len if use_key else None
    boundary = boundary_of if use_boundary else None
    batches = list(it.BucketedReadaheadBatchIterator(
        native(items), read_ahead, key, batch_size, boundary_key=boundary, shuffle=shuffle,
        seed=seed,
    ))
    flat = [item for batch in batches for item in batch]
    assert sorted(flat) == sorted(items)
    # Batches never cross read-ahead windows, and each window's items come out together.
    offset = 0
    for batch in batches:
        assert batch, "empty batch"
        assert offset // read_ahead == (offset + len(batch) - 1) // read_ahead
        offset += len(batch)
        limit = batch_size if isinstance(batch_size, int) else max(1, batch_size(batch[0]))
        assert len(batch) <= limit
        if boundary is not None:
            assert len({boundary(item) for item in batch}) == 1
        if key is not None:
            assert [len(item) for item in batch] == sorted(map(len, batch), reverse=True)
    for start in range(0, len(items), read_ahead):
        window = items[start : start + read_ahead]
        out = flat[start : start + read_ahead]
        assert sorted(out) == sorted(window)
        if not shuffle:
            expected = window if key is None else sorted(window, key=len, reverse=True)
            assert out == expected
    assert batches == bucketed_model(
        items, read_ahead, key, batch_size, boundary, shuffle, seed
    )


# -- ChunkedSourceIterator -----------------------------------------------------------------


@FAST
@given(items=st.lists(st.integers(), max_size=60), num_instances=st.integers(1, 12))
def test_chunked_source_partitions_in_rank_order(items: list[int], num_instances: int) -> None:
    shares = [
        list(it.ChunkedSourceIterator(items, num_instances=num_instances, instance_rank=rank))
        for rank in range(num_instances)
    ]
    assert [item for share in shares for item in share] == items
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1
    base, extra = divmod(len(items), num_instances)
    assert sizes == [base + 1] * extra + [base] * (num_instances - extra)


# -- InfinitePermutationSourceIterator -----------------------------------------------------


@FAST
@given(
    per_rank=st.integers(1, 6),
    num_instances=st.integers(1, 5),
    passes=st.integers(1, 4),
    seed=seeds,
    shuffle=st.booleans(),
)
def test_infinite_permutation_ranks_cover_each_pass(
    per_rank: int, num_instances: int, passes: int, seed: Any, shuffle: bool
) -> None:
    items = [f"p{i}" for i in range(per_rank * num_instances)]
    length = len(items)
    outputs = [
        take(it.InfinitePermutationSourceIterator(
            items, seed=seed, shuffle=shuffle, num_instances=num_instances, instance_rank=rank
        ), passes * length // num_instances)
        for rank in range(num_instances)
    ]
    union = Counter(item for output in outputs for item in output)
    assert union == Counter({item: passes for item in items})
    # Interleaving the ranks gives back one stream of whole passes (the documented one).
    stream = [outputs[p % num_instances][p // num_instances] for p in range(passes * length)]
    rng = random.Random(seed)
    for start in range(0, len(stream), length):
        expected = list(items)
        if shuffle:
            rng.shuffle(expected)
        assert stream[start : start + length] == expected


@FAST
@given(
    length=st.integers(1, 9),
    num_instances=st.integers(1, 12),
    data=st.data(),
    passes=st.integers(1, 4),
    seed=seeds,
)
def test_infinite_permutation_passes_of_one_rank(
    length: int, num_instances: int, data: st.DataObject, passes: int, seed: Any
) -> None:
    rank = data.draw(st.integers(0, num_instances - 1), label="rank")
    items = [f"q{i}" for i in range(length)]
    single = take(it.InfinitePermutationSourceIterator(items, seed=seed), passes * length)
    for start in range(0, len(single), length):
        assert sorted(single[start : start + length]) == sorted(items)
    # Any number of ranks, even more than items, yields promptly: rank r takes the
    # positions r, r + n, ... of the single-rank stream.
    count = max(1, passes * length // num_instances)
    strided = take(it.InfinitePermutationSourceIterator(
        items, seed=seed, num_instances=num_instances, instance_rank=rank
    ), count)
    whole = take(it.InfinitePermutationSourceIterator(items, seed=seed),
                 rank + num_instances * count)
    assert strided == whole[rank::num_instances][:count]


# -- WindowedIterator ----------------------------------------------------------------------


@FAST
@given(items=st.lists(st.integers(0, 9), max_size=200), width=st.integers(1, 80), data=st.data())
def test_windowed_yields_sliding_windows(items: list[int], width: int, data: st.DataObject) -> None:
    expected = [tuple(items[i : i + width]) for i in range(len(items) - width + 1)]
    windows = it.WindowedIterator(native(items), width)
    position = data.draw(st.integers(0, len(expected)), label="position")
    head = take(windows, position)
    state = json_copy(windows.getstate())
    assert head + list(windows) == expected
    fresh = it.WindowedIterator(native(items), width)
    fresh.setstate(state)
    assert list(fresh) == expected[position:]


# -- state size and contents ---------------------------------------------------------------


def distinct(count: int) -> list[str]:
    """Items that cannot be mistaken for anything else in a JSON state."""
    return [f"ITEM{i:07d}" for i in range(count)]


def select_repeated(item: str) -> list[str]:
    return [item] * (int(item[4:]) % 3)  # some collections are empty


CHUNKS = [distinct(50_000)[c * 25 : c * 25 + c % 7] for c in range(40)]


read_chunk = ChunkReader(CHUNKS)


# name -> build(seed, size); none of these states may hold items.
PIPELINES: dict[str, Callable[[int, int], it.CheckpointableIterator[Any]]] = {
    "BlockwiseShuffleIterator": lambda seed, size: it.BlockwiseShuffleIterator(
        native(distinct(5_000)), size, seed
    ),
    "BucketedReadaheadBatchIterator": lambda seed, size: it.BucketedReadaheadBatchIterator(
        native(distinct(8_000)), 3 * size + 1, len, size % 4 + 1, seed=seed
    ),
    "BucketedReadaheadBatchIterator-dynamic": lambda seed, size: (
        it.BucketedReadaheadBatchIterator(
            native(distinct(8_000)), 2 * size + 1, key=lambda item: item[-1],
            batch_size=lambda first: int(first[-1]) % 4, boundary_key=lambda item: item[-2],
            shuffle=False, seed=seed,
        )
    ),
    "InfinitePermutationSourceIterator": lambda seed, size: (
        it.InfinitePermutationSourceIterator(
            distinct(size), seed=seed, num_instances=3, instance_rank=size % 3
        )
    ),
    "SelectManyIterator": lambda seed, size: it.SelectManyIterator(
        it.InfinitePermutationSourceIterator(distinct(size + 2), seed=seed), select_repeated
    ),
    "SelectManyIterator-lists": lambda seed, size: it.SelectManyIterator(
        native([distinct(size)] * 2_000)
    ),
    "chunked_dataset_iterator": lambda seed, size: chunked_dataset_iterator(
        list(range(1, 40)), read_chunk, buffer_size=size, seed=seed, num_instances=2,
        instance_rank=seed % 2,
    ),
    "chunked_dataset_iterator-eval": lambda seed, size: chunked_dataset_iterator(
        list(range(40)) * 15, read_chunk, buffer_size=size, train=False, shuffle=False
    ),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@SLOW
@given(seed=st.integers(0, 10**6), size=st.integers(1, 40))
def test_state_size_does_not_grow_with_position(name: str, seed: int, size: int) -> None:
    build = PIPELINES[name]
    pipeline = build(seed, size)
    take(pipeline, 10)
    early = json.dumps(pipeline.getstate())
    got = take(pipeline, 1_200)
    assert len(got) == 1_200, "the source is too short for this test"
    late = json.dumps(pipeline.getstate())
    assert abs(len(late) - len(early)) <= 12, f"state grew:\n{early}\n{late}"
    assert "ITEM" not in early
    assert "ITEM" not in late
    pipeline.close()


# -- seed=None -----------------------------------------------------------------------------


def noisy(rng: random.Random, item: int) -> float:
    return item + rng.gauss(0.0, 1.0)


UNSEEDED: dict[str, Callable[[], it.CheckpointableIterator[Any]]] = {
    "InfinitePermutationSourceIterator": lambda: it.InfinitePermutationSourceIterator(
        list(range(7)), seed=None, num_instances=2, instance_rank=1
    ),
    "RandomIterator": lambda: it.RandomIterator(seed=None),
    "SamplingRandomMapIterator": lambda: it.SamplingRandomMapIterator(
        native(range(60)), noisy, seed=None
    ),
    "BlockwiseShuffleIterator": lambda: it.BlockwiseShuffleIterator(
        native(range(60)), 7, seed=None
    ),
    "BufferedShuffleIterator": lambda: it.BufferedShuffleIterator(
        native(range(60)), 7, seed=None
    ),
    "BucketedReadaheadBatchIterator": lambda: it.BucketedReadaheadBatchIterator(
        native(range(60)), 9, key=lambda item: item % 5, batch_size=2, seed=None
    ),
    "create_source_iterator": lambda: it.create_source_iterator(list(range(5)), seed=None),
    "chunked_dataset_iterator": lambda: chunked_dataset_iterator(
        list(range(1, 12)), read_chunk, buffer_size=6, seed=None
    ),
    "chunked_dataset_iterator-windowed": lambda: chunked_dataset_iterator(
        list(range(1, 12)), read_chunk, buffer_size=6, seed=None, use_windowed=True
    ),
}


@pytest.mark.parametrize("name", sorted(UNSEEDED))
@settings(max_examples=examples(0.2))
@given(position=st.integers(0, 50))
def test_unseeded_stages_reproduce(name: str, position: int) -> None:
    build = UNSEEDED[name]
    pipeline = build()
    first = take(pipeline, 50)
    pipeline.setstate(None)
    assert take(pipeline, 50) == first, "setstate(None) does not replay the stream"
    pipeline.setstate(None)
    take(pipeline, position)
    state = pipeline.getstate()
    for restored_state in (state, json_copy(state)):
        fresh = build()
        fresh.setstate(restored_state)
        assert take(fresh, 50 - position) == first[position:], (
            "a fresh seed=None instance restored from a state does not continue the stream"
        )
        fresh.close()
    pipeline.close()
