"""SkipIterator: ranges of a stream skipped on purpose, remembered by checkpoints; fast-forward
without running the transforms of the maps above the skipped items' source."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _profiles import examples
from _streams import roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like.stages.skipping import SkipIterator

ranges = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 8)).map(
    lambda pair: (pair[0], pair[0] + pair[1])), max_size=4)


@settings(max_examples=examples(0.6))
@given(n=st.integers(0, 30), skip=ranges, point=st.integers(0, 30))
def test_skips_exactly_the_ranges_and_restores_exactly(
    n: int, skip: list[tuple[int, int]], point: int
) -> None:
    def build() -> SkipIterator[int]:
        return SkipIterator(it.NativeCheckpointableIterator(list(range(n))), skip=skip)

    expected = [x for x in range(n) if not any(a <= x < b for a, b in skip)]
    pipeline = build()
    assert list(pipeline) == expected
    assert pipeline.skipped == n - len(expected)
    first = build()
    taken = [next(first) for _ in range(min(point, len(expected)))]
    again = build()
    again.setstate(roundtrip(first.getstate()))
    assert taken + list(again) == expected
    assert again.getstate() == pipeline.getstate()


class Counting:
    """Adds one to each item of a batch, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: list[int]) -> list[int]:
        self.calls += 1
        return [x + 1 for x in batch]


def test_fast_forward_pulls_below_plain_maps_without_transforming() -> None:
    first, second = Counting(), Counting()
    batches = it.FixedBatchIterator(it.NativeCheckpointableIterator(list(range(100))), 4)
    pipeline = SkipIterator(it.MapIterator(it.MapIterator(batches, first), second))
    assert next(pipeline) == first_batch_plus_two(0)
    pipeline.skip_next(10)
    assert next(pipeline) == first_batch_plus_two(11)
    assert (first.calls, second.calls) == (2, 2)  # the ten skipped batches were not mapped
    assert (pipeline.position, pipeline.skipped) == (12, 10)
    state = roundtrip(pipeline.getstate())
    assert state["done"] == [[1, 11]]
    again = SkipIterator(it.MapIterator(it.MapIterator(
        it.FixedBatchIterator(it.NativeCheckpointableIterator(list(range(100))), 4), first),
        second))
    again.setstate(state)
    assert list(again) == [first_batch_plus_two(k) for k in range(12, 25)]


def first_batch_plus_two(k: int) -> list[int]:
    return [x + 2 for x in range(4 * k, 4 * k + 4)]


def test_loss_spike_skip_is_remembered_by_later_checkpoints() -> None:
    def build() -> SkipIterator[list[int]]:
        return SkipIterator(
            it.FixedBatchIterator(it.NativeCheckpointableIterator(list(range(200))), 5)
        )

    def train(pipeline: SkipIterator[list[int]], steps: int, spike_at: int | None) -> list[Any]:
        seen: list[Any] = []
        checkpoints: dict[int, Any] = {}
        for _ in range(steps):
            batch = next(pipeline)
            seen.append(batch[0])
            if batch[0] == spike_at:
                pipeline.skip_next(3)  # the loss spiked: drop the next three batches
            checkpoints[len(seen)] = roundtrip(pipeline.getstate())
        return [seen, checkpoints]

    seen, checkpoints = train(build(), 20, spike_at=35)
    assert seen[:9] == [0, 5, 10, 15, 20, 25, 30, 35, 55]  # batches 8, 9, 10 skipped
    # A restart from a checkpoint taken after the spike (before or after the skipped range
    # was passed) skips the same batches, with no help from the training loop.
    for step in (8, 12):
        restarted = build()
        restarted.setstate(checkpoints[step])
        rest, _ = train(restarted, 20 - step, spike_at=None)
        assert seen[:step] + rest == seen


def test_skip_ranges_from_the_constructor_merge_with_the_state() -> None:
    def build(skip: list[tuple[int, int]]) -> SkipIterator[int]:
        return SkipIterator(it.NativeCheckpointableIterator(list(range(30))), skip=skip)

    pipeline = build([(2, 4)])
    assert [next(pipeline) for _ in range(5)] == [0, 1, 4, 5, 6]
    pipeline.skip_range(10, 12)
    state = roundtrip(pipeline.getstate())
    assert state["pending"] == [[10, 12]]
    assert state["done"] == [[2, 4]]
    # At a restart the config adds a range; the one passed before is not skipped again.
    again = build([(2, 4), (8, 11), (20, 21)])
    again.setstate(state)
    assert again.pending == [(8, 12), (20, 21)]
    assert list(again) == [7, *range(12, 20), *range(21, 30)]


def test_skip_range_already_passed_is_refused_or_trimmed(caplog: pytest.LogCaptureFixture) -> None:
    pipeline = SkipIterator(it.NativeCheckpointableIterator(list(range(10))))
    for _ in range(4):
        next(pipeline)
    with pytest.raises(ValueError, match=r"SkipIterator.skip_range: the range \[1, 3\) ends "
                       "before the current position 4: those items were already yielded"):
        pipeline.skip_range(1, 3)
    with caplog.at_level(logging.WARNING, logger="infinibatch_like"):
        pipeline.skip_range(2, 6)
    assert "items 2..3 of [2, 6) were already yielded; skipping from 4" in caplog.text
    assert list(pipeline) == [6, 7, 8, 9]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: p.skip_range(5, 5), ValueError,
         r"SkipIterator: skip_range: the range \(5, 5\) is empty; stop must be > start"),
        (lambda p: p.skip_range(-1, 2), ValueError, "skip_range: start must be >= 0, got -1"),
        (lambda p: p.skip_next(-2), ValueError, "skip_next: count must be >= 0, got -2"),
        (lambda p: p.skip_next(1.5), TypeError, "skip_next: count must be an int, got 1.5"),
        (lambda p: SkipIterator(it.NativeCheckpointableIterator([1]), skip=[(1, 2, 3)]),
         TypeError,
         r"SkipIterator: skip takes ranges \(start, stop\) of positions, got \(1, 2, 3\)"),
        (lambda p: SkipIterator([1, 2]), ValueError,  # type: ignore[arg-type]
         "SkipIterator: source_iterator must be a CheckpointableIterator, got list"),
    ],
)
def test_bad_ranges_are_refused(call: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call(SkipIterator(it.NativeCheckpointableIterator(list(range(10)))))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pending", [[5, 3]], r"state field 'pending\[0\]' must be a range \[start, stop\] with "
                              r"0 <= start < stop, got \[5, 3\]"),
        ("done", [[1]], r"state field 'done\[0\]' must be a range"),
        ("position", -3, "state field 'position' must be >= 0, got -3"),
        ("skipped", -1, "state field 'skipped' must be >= 0, got -1"),
    ],
)
def test_damaged_skip_states_are_refused(field: str, value: Any, message: str) -> None:
    pipeline = SkipIterator(it.NativeCheckpointableIterator(list(range(10))), skip=[(3, 5)])
    state = pipeline.getstate()
    state[field] = value
    with pytest.raises(StateMismatchError, match=f"SkipIterator.*{message}"):
        SkipIterator(it.NativeCheckpointableIterator(list(range(10)))).setstate(state)
