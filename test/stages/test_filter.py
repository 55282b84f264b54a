"""FilterIterator: the items for which a predicate holds, in order, with exact checkpoints; a
predicate's error names the stage, and a restore re-attempts the item it failed on."""

from __future__ import annotations

import json
from itertools import islice
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import FilterIterator
from infinibatch_like.distributed import ShardedIterator
from infinibatch_like.distributed.elastic import elastic_state
from infinibatch_like.testing import check_resume


def is_even(x: int) -> bool:
    return x % 2 == 0


def divisible(divisor: int) -> Any:
    return lambda x: x % divisor == 0


@settings(deadline=None)
@given(
    items=st.lists(st.integers(-50, 50), max_size=40),
    divisor=st.integers(1, 5),
    point=st.integers(0, 40),
)
def test_yields_the_items_the_predicate_keeps_and_resumes_at_any_point(
    items: list[int], divisor: int, point: int
) -> None:
    def build() -> FilterIterator[int]:
        return FilterIterator(it.NativeCheckpointableIterator(items), divisible(divisor))

    expected = [x for x in items if x % divisor == 0]
    assert list(build()) == expected
    first = build()
    taken = [next(first) for _ in range(min(point, len(expected)))]
    state = json.loads(json.dumps(first.getstate()))
    resumed = build()
    resumed.setstate(state)
    assert taken + list(resumed) == expected
    assert list(first) == expected[len(taken) :]  # getstate() did not move it


def test_state_is_the_sources_position_after_the_last_kept_item() -> None:
    pipeline = FilterIterator(it.NativeCheckpointableIterator([1, 3, 4, 5, 7, 8]), is_even)
    assert next(pipeline) == 4
    state = pipeline.getstate()
    assert set(state) == {"stage", "source"}
    assert state["source"]["consumed"] == 3


def test_check_resume_passes_over_a_shuffled_chunked_source() -> None:
    def build() -> it.CheckpointableIterator[str]:
        chunks = it.InfinitePermutationSourceIterator(list(range(6)), seed=2, epochs=2)
        lines = it.SelectManyIterator(chunks, lambda c: [f"{c}-{i}" for i in range(c + 1)])
        return FilterIterator(lines, lambda line: line.endswith(("0", "2")))

    check_resume(build, max_items=30)


def raise_on_seven(x: int) -> bool:
    if x == 7:
        raise ValueError("seven")
    return x % 2 == 1


def test_a_predicate_error_names_the_stage_and_a_restore_retries_the_item() -> None:
    pipeline = FilterIterator(it.NativeCheckpointableIterator(list(range(10))), raise_on_seven)
    assert [next(pipeline) for _ in range(3)] == [1, 3, 5]
    with pytest.raises(ValueError, match="seven") as raised:
        next(pipeline)
    assert raised.value.__notes__ == [
        "(raised by FilterIterator's predicate raise_on_seven on item 7)"
    ]
    state = pipeline.getstate()  # steps back to item 7
    assert state["source"]["consumed"] == 7
    fresh = FilterIterator(it.NativeCheckpointableIterator(list(range(10))), raise_on_seven)
    fresh.setstate(state)
    with pytest.raises(ValueError, match="seven"):  # the restore calls the predicate on 7 again
        next(fresh)


def parse(word: str) -> int:
    return int(word)


def test_a_builtin_predicate_error_below_a_map_names_the_filter() -> None:
    # builtin predicates leave no Python frame: the stage is found by its place in the chain
    words = it.NativeCheckpointableIterator(["12", "ab", 3])
    pipeline = it.MapIterator(FilterIterator(words, str.isdigit), parse)
    assert next(pipeline) == 12
    with pytest.raises(TypeError) as raised:
        next(pipeline)
    assert raised.value.__notes__ == ["(raised by FilterIterator's predicate str.isdigit)"]


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((it.NativeCheckpointableIterator([1]), 3), TypeError,
         "FilterIterator: predicate must be callable, got 3"),
        (([1, 2], is_even), ValueError,
         "FilterIterator: source_iterator must be a CheckpointableIterator, got list"),
    ],
)
def test_arguments_are_checked(arguments: tuple[Any, ...], error: type, message: str) -> None:
    with pytest.raises(error, match=f"^{message}$"):
        FilterIterator(*arguments)


def shard_numbers(shard: int, num_shards: int) -> it.NativeCheckpointableIterator[int]:
    return it.NativeCheckpointableIterator(list(range(shard, 60, num_shards)))


def test_above_a_sharded_iterator_it_resumes_on_another_number_of_ranks() -> None:
    old = [FilterIterator(ShardedIterator(shard_numbers, 6, rank, 2), is_even) for rank in range(2)]
    taken = [item for pipeline in old for item in islice(pipeline, 5)]
    states = [pipeline.getstate() for pipeline in old]
    rest = []
    for rank in range(3):
        pipeline = FilterIterator(ShardedIterator(shard_numbers, 6, rank, 3), is_even)
        pipeline.setstate(elastic_state(pipeline, states, rank, 3))
        rest += list(pipeline)
    assert sorted(taken + rest) == list(range(0, 60, 2))  # every kept item once
