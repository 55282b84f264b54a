"""Batched transforms: BatchMapIterator, and ParallelMapIterator(batched=True) in worker
processes and threads."""

from __future__ import annotations

import json
import multiprocessing
import threading
from typing import Any

import numpy as np
import pytest
from _counting import Counter
from _profiles import examples
from _streams import native
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like.testing import assert_checkpointable, check_resume

METHODS = multiprocessing.get_all_start_methods()


def square_each(items: list[int]) -> list[int]:
    return [x * x for x in items]


def drop_one(items: list[int]) -> list[int]:
    return items[1:]


def as_rows(items: list[int]) -> np.ndarray:
    return np.outer(np.asarray(items), np.arange(3))


def fail_on_batch_with_9(items: list[int]) -> list[int]:
    if 9 in items:
        raise KeyError("nine")
    return items


class Calls:
    """A batched transform recording the sizes of its batches."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.sizes.append(len(items))
        return square_each(items)


@pytest.mark.parametrize("batch_size", [1, 3, 7, 50])
def test_output_is_the_per_item_map_and_the_transform_gets_whole_batches(batch_size: int) -> None:
    calls = Calls()
    pipeline = it.BatchMapIterator(native(20), calls, batch_size)
    assert list(pipeline) == [x * x for x in range(20)]
    full, last = divmod(20, batch_size)
    assert calls.sizes == [batch_size] * full + ([last] if last else [])


def test_a_transform_returning_an_array_yields_its_rows() -> None:
    rows = list(it.BatchMapIterator(native(5), as_rows, 2))
    assert [row.tolist() for row in rows] == [[0, x, 2 * x] for x in range(5)]


def test_a_checkpoint_inside_a_batch_restores_exactly_and_rereads_one_batch_at_most() -> None:
    reference = [x * x for x in range(30)]
    for k in range(31):
        pipeline = it.BatchMapIterator(it.MapIterator(native(30), Counter()), square_each, 7)
        for _ in range(k):
            next(pipeline)
        state = json.loads(json.dumps(pipeline.getstate()))
        counting = Counter()
        resumed = it.BatchMapIterator(it.MapIterator(native(30), counting), square_each, 7)
        resumed.setstate(state)
        first = next(resumed, None)
        assert counting.calls == (min(7, 30 - (k - k % 7)) if k < 30 else 0)  # item k's batch
        assert [first, *resumed] == (reference[k:] or [None])
        assert state["offset"] == (k % 7 if k < 30 else 0)


def test_a_wrong_number_of_outputs_names_the_stage() -> None:
    pipeline = it.BatchMapIterator(native(6), drop_one, 3)
    with pytest.raises(ValueError, match=r"BatchMapIterator: its batched transform drop_one "
                       r"returned 2 outputs for 3 items; it must return one per item"):
        next(pipeline)


def test_an_error_of_the_transform_leaves_the_state_at_its_batch() -> None:
    pipeline = it.BatchMapIterator(native(12), fail_on_batch_with_9, 4)
    assert [next(pipeline) for _ in range(8)] == list(range(8))
    with pytest.raises(KeyError, match="nine"):
        next(pipeline)
    state = pipeline.getstate()
    assert state["offset"] == 0
    resumed = it.BatchMapIterator(native(12), square_each, 4)
    resumed.setstate(state)
    assert list(resumed) == [x * x for x in range(8, 12)]


def test_argument_and_state_errors() -> None:
    with pytest.raises(ValueError, match="BatchMapIterator: batch_size"):
        it.BatchMapIterator(native(3), square_each, 0)
    with pytest.raises(TypeError, match="BatchMapIterator: transform_batch"):
        it.BatchMapIterator(native(3), 5, 2)  # type: ignore[arg-type]
    pipeline = it.BatchMapIterator(native(9), square_each, 3)
    state = pipeline.getstate()
    with pytest.raises(StateMismatchError, match=r"BatchMapIterator: state field 'offset' must be "
                       r">= 0 and < batch_size=3, got 1000000000"):
        pipeline.setstate({**state, "offset": 10**9})
    with pytest.raises(ValueError, match="batch_size"):
        it.BatchMapIterator(native(9), square_each, 4).setstate(state)


def test_batch_map_passes_the_checkpoint_checks_and_resumes_exactly() -> None:
    assert_checkpointable(lambda: it.BatchMapIterator(native(23), square_each, 5), max_items=30)
    check_resume(lambda: it.BatchMapIterator(native(23), square_each, 5), max_items=30)


@settings(max_examples=examples(0.4))
@given(
    n=st.integers(0, 40),
    batch_size=st.integers(1, 12),
    cuts=st.lists(st.integers(0, 45), max_size=4),
)
def test_any_chain_of_restores_gives_the_per_item_map(
    n: int, batch_size: int, cuts: list[int]
) -> None:
    got: list[int] = []
    state = None
    for cut in [*sorted(cuts), 10**6]:
        pipeline = it.BatchMapIterator(native(n), square_each, batch_size)
        pipeline.setstate(state)
        while len(got) < cut:
            item = next(pipeline, None)
            if item is None:
                break
            got.append(item)
        state = json.loads(json.dumps(pipeline.getstate()))
        assert 0 <= state["offset"] < batch_size
    assert got == [x * x for x in range(n)]


# -- in worker processes and threads --------------------------------------------------------


@pytest.mark.parametrize("mode_method", [("thread", None)] + [("process", m) for m in METHODS])
def test_parallel_batched_map_restores_exactly_between_items_of_a_batch(mode_method: Any) -> None:
    mode, method = mode_method

    def build() -> it.ParallelMapIterator:
        return it.ParallelMapIterator(
            native(40), square_each, 2, 6, snapshot_every=5, mode=mode, start_method=method,
            batched=True,
        )

    with build() as pipeline:
        reference = list(pipeline)
    assert reference == [x * x for x in range(40)]
    with build() as pipeline:
        for _ in range(9):  # inside the second batch of 6
            next(pipeline)
        state = pipeline.getstate()
    with build() as resumed:
        resumed.setstate(json.loads(json.dumps(state)))
        assert list(resumed) == reference[9:]


def test_batch_calls_run_at_once_in_worker_threads() -> None:
    # Each call waits for the other at a barrier (as a tokenizer's batch call releases the
    # GIL while it encodes): two calls in flight at once pass it, serialized calls break it.
    meeting = threading.Barrier(2, timeout=10)

    def meet_then_square(items: list[int]) -> list[int]:
        meeting.wait()
        return square_each(items)

    with it.ParallelMapIterator(
        native(8), meet_then_square, 2, 2, mode="thread", batched=True
    ) as pipeline:
        assert list(pipeline) == [x * x for x in range(8)]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_parallel_batched_map_names_a_wrong_number_of_outputs(mode: str) -> None:
    with it.ParallelMapIterator(native(9), drop_one, 2, 3, mode=mode, batched=True) as pipeline:
        with pytest.raises(ValueError, match="ParallelMapIterator: its batched transform drop_one "
                           "returned 2 outputs for 3 items"):
            next(pipeline)
        assert pipeline.getstate()["replay"] == 0


def test_parallel_batched_map_refuses_a_skip_policy() -> None:
    from infinibatch_like.stages.bad_records import SkipPolicy

    with pytest.raises(ValueError, match=r"ParallelMapIterator: on_error=.* cannot be combined"):
        it.ParallelMapIterator(native(3), square_each, 1, 2, batched=True, on_error=SkipPolicy(1))
    with pytest.raises(TypeError, match="ParallelMapIterator: batched must be a bool"):
        it.ParallelMapIterator(native(3), square_each, 1, 2, batched=1)  # type: ignore[arg-type]
