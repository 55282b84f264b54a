"""WeightedMultiplexIterator: frequencies, the exact schedule's bound, curricula, resumes.

infinibatch 0.1.1 has no weighted multiplexer, so there is no differential test against it;
the contract checks are in test_contract.py (CASES).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from fractions import Fraction
from functools import partial
from typing import Any

import pytest
from _profiles import examples
from _streams import take
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError

PROPERTY = settings(max_examples=examples(1.5), suppress_health_check=[HealthCheck.too_slow])

weight_values = st.one_of(
    st.integers(0, 12),
    st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.7, 2.5, 1e-3, 1e6]),
)
weight_lists = st.lists(weight_values, min_size=1, max_size=6).filter(any)


def pair(source: int, position: int) -> tuple[int, int]:
    return source, position


def tagged(source: int, length: int) -> it.MapIterator[tuple[int, int]]:
    """The items (source, 0), (source, 1), ... (source, length - 1)."""
    return it.MapIterator(it.NativeCheckpointableIterator(range(length)), partial(pair, source))


def mixer(
    weights: list[Any], lengths: list[int] | None = None, **kwargs: Any
) -> it.WeightedMultiplexIterator[tuple[int, int]]:
    sizes = lengths or [10**6] * len(weights)
    return it.WeightedMultiplexIterator(
        [tagged(index, size) for index, size in enumerate(sizes)], weights, **kwargs
    )


def assert_low_discrepancy(sources: list[int], weights: list[float]) -> None:
    """After every prefix, each source's count is within 1 - 1/(2k-2) of its share."""
    exact = [Fraction(weight) for weight in weights]
    total = sum(exact)
    live = sum(1 for weight in exact if weight > 0)
    bound = Fraction(1) - Fraction(1, 2 * live - 2) if live > 1 else Fraction(0)
    counts = [0] * len(weights)
    for number, source in enumerate(sources, start=1):
        counts[source] += 1
        for index, weight in enumerate(exact):
            assert abs(counts[index] - number * weight / total) <= bound, (number, counts)


# -- exact schedule ---------------------------------------------------------------------


@PROPERTY
@given(weights=weight_lists, length=st.integers(1, 400))
def test_exact_schedule_stays_within_the_bound(weights: list[Any], length: int) -> None:
    sources = [source for source, _ in take(mixer(weights, exact=True), length)]
    assert_low_discrepancy(sources, [float(weight) for weight in weights])


def test_exact_schedule_gives_exact_frequencies_and_interleaves() -> None:
    items = take(mixer([1, 2, 3], exact=True), 600)
    assert Counter(source for source, _ in items) == {0: 100, 1: 200, 2: 300}
    assert [source for source, _ in items[:6]] == [2, 1, 2, 0, 1, 2]
    # Each source's items come in their own order.
    for source in range(3):
        positions = [position for origin, position in items if origin == source]
        assert positions == list(range(len(positions)))


def test_exact_schedule_restarts_its_bound_when_a_source_ends() -> None:
    pipeline = mixer([1, 1, 2], lengths=[5, 1000, 1000], exact=True)
    sources, dropped_at = [], None
    for number in range(400):
        sources.append(next(pipeline)[0])
        if dropped_at is None and not pipeline.getstate()["active"][0]:
            dropped_at = number  # the pull that found source 0 ended was in this next()
    assert dropped_at is not None
    assert sources.count(0) == 5
    assert_low_discrepancy([source - 1 for source in sources[dropped_at:]], [1, 2])


# -- random draws -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, "corpus-mix"])
def test_random_frequencies_match_the_weights(seed: Any) -> None:
    weights = [1, 2.5, 0.5, 4]
    items = 40_000
    counts = Counter(source for source, _ in take(mixer(weights, seed=seed), items))
    total = sum(weights)
    expected = [items * weight / total for weight in weights]
    chi_square = sum((counts[i] - e) ** 2 / e for i, e in enumerate(expected))
    assert chi_square < 16.27, (counts, chi_square)  # p = 0.001 for 3 degrees of freedom


def test_random_draws_never_pick_a_zero_weight_source() -> None:
    counts = Counter(source for source, _ in take(mixer([0, 1, 0.0, 3], seed=2), 2000))
    assert set(counts) == {1, 3}


@PROPERTY
@given(weights=weight_lists, seed=st.integers(0, 2**40), exact=st.booleans())
def test_same_arguments_give_the_same_stream_on_every_rank(
    weights: list[Any], seed: int, exact: bool
) -> None:
    streams = [take(mixer(weights, seed=seed, exact=exact), 120) for _ in range(3)]
    assert streams[0] == streams[1] == streams[2]


def test_different_seeds_give_different_random_streams() -> None:
    assert take(mixer([1, 1], seed=1), 64) != take(mixer([1, 1], seed=2), 64)


def test_seed_none_is_drawn_once_and_kept() -> None:
    pipeline = mixer([1, 1], seed=None)
    first = take(pipeline, 50)
    seed = pipeline.getstate()["seed"]
    pipeline.setstate(None)
    assert take(pipeline, 50) == first
    other = mixer([1, 1], seed=None)
    other.setstate(pipeline.getstate())
    assert other.getstate()["seed"] == seed


# -- finite sources -----------------------------------------------------------------------


@PROPERTY
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5),
    data=st.data(),
    exact=st.booleans(),
)
def test_all_exhausted_yields_every_item_of_every_weighted_source_once(
    lengths: list[int], data: st.DataObject, exact: bool
) -> None:
    weights = data.draw(st.lists(weight_values, min_size=len(lengths), max_size=len(lengths)))
    if not any(weights):
        weights[0] = 1
    items = list(mixer(weights, lengths, seed=3, exact=exact))
    for source, length in enumerate(lengths):
        positions = [position for origin, position in items if origin == source]
        expected = length if weights[source] > 0 else 0
        assert positions == list(range(expected))


@PROPERTY
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=5),
    seed=st.integers(0, 99),
    exact=st.booleans(),
)
def test_first_exhausted_ends_when_a_source_first_runs_out(
    lengths: list[int], seed: int, exact: bool
) -> None:
    weights = [1] * len(lengths)
    pipeline = mixer(weights, lengths, seed=seed, exact=exact, stop_on="first_exhausted")
    items = list(pipeline)
    counts = Counter(source for source, _ in items)
    ended = [source for source, length in enumerate(lengths) if counts[source] == length]
    assert ended, "some source must have run out"
    # The stream is the prefix of the all_exhausted stream up to the failed pull.
    longer = list(mixer(weights, lengths, seed=seed, exact=exact))
    assert longer[: len(items)] == items
    assert pipeline.getstate()["ended"] is True
    assert next(pipeline, None) is None


def test_stream_ends_when_only_zero_weight_sources_remain() -> None:
    assert list(mixer([1, 0], [3, 5], exact=True)) == [(0, 0), (0, 1), (0, 2)]


# -- set_weights and resumes ---------------------------------------------------------------


@st.composite
def curricula(draw: st.DrawFn) -> tuple[int, dict[int, list[Any]]]:
    count = draw(st.integers(1, 4))
    steps = draw(st.lists(st.integers(0, 80), max_size=4, unique=True))
    changes = {}
    for step in steps:
        weights = draw(st.lists(weight_values, min_size=count, max_size=count))
        changes[step] = weights if any(weights) else [1] * count
    return count, changes


def run_curriculum(
    pipeline: it.WeightedMultiplexIterator[Any],
    changes: dict[int, list[Any]],
    start: int,
    stop: int,
) -> tuple[list[Any], list[Any]]:
    """Items and states (taken before each item) from `start` to `stop`, with changes."""
    items, states = [], []
    for step in range(start, stop):
        if step in changes:
            pipeline.set_weights(changes[step])
        states.append(json.loads(json.dumps(pipeline.getstate())))
        items.append(next(pipeline, None))
    return items, states


@PROPERTY
@given(
    plan=curricula(),
    exact=st.booleans(),
    stop_first=st.booleans(),
    seed=st.integers(0, 50),
    data=st.data(),
)
def test_restores_after_set_weights_continue_exactly(
    plan: tuple[int, dict[int, list[Any]]],
    exact: bool,
    stop_first: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    count, changes = plan
    lengths = data.draw(st.lists(st.integers(0, 60), min_size=count, max_size=count))
    options = {
        "seed": seed,
        "exact": exact,
        "stop_on": "first_exhausted" if stop_first else "all_exhausted",
    }
    total = 90
    items, states = run_curriculum(mixer([1] * count, lengths, **options), changes, 0, total)
    point = data.draw(st.integers(0, total - 1))
    fresh = mixer([1] * count, lengths, **options)
    fresh.setstate(states[point])
    assert fresh.getstate() == states[point]
    later = {step: weights for step, weights in changes.items() if step > point}
    resumed, _ = run_curriculum(fresh, later, point, total)
    assert resumed == items[point:]


def test_set_weights_takes_effect_from_the_next_item() -> None:
    pipeline = mixer([1, 0], exact=True)
    assert [source for source, _ in take(pipeline, 3)] == [0, 0, 0]
    pipeline.set_weights([0, 2.0])
    assert pipeline.weights == [0.0, 2.0]
    assert pipeline.getstate()["weights"] == [0.0, 2.0]
    assert [source for source, _ in take(pipeline, 3)] == [1, 1, 1]


def test_exact_schedule_restarts_its_bound_after_set_weights() -> None:
    pipeline = mixer([5, 1, 1], exact=True)
    take(pipeline, 37)
    pipeline.set_weights([1, 1, 3])
    sources = [source for source, _ in take(pipeline, 300)]
    assert_low_discrepancy(sources, [1, 1, 3])


def test_state_has_constant_size() -> None:
    pipeline = mixer([1, 2, 3, 0.5])
    sizes = []
    for _ in range(5000):
        state = pipeline.getstate()
        own = {key: value for key, value in state.items() if key != "sources"}
        assert [len(own[key]) for key in ("weights", "counts", "active")] == [4, 4, 4]
        sizes.append(len(json.dumps(own)))
        next(pipeline)
    assert max(sizes) - min(sizes) <= 20  # only the digits of a few counters grow


def test_restore_refuses_foreign_weights_and_seeds() -> None:
    pipeline = mixer([1, 1], seed=4)
    next(pipeline)
    state = pipeline.getstate()
    for key, value, message in [
        ("weights", [1.0], "state field 'weights' holds 1 items, expected 2 (one per source)"),
        ("weights", [-1.0, 1.0], "state field 'weights[0]' must be finite and >= 0, got -1.0"),
        ("weights", [0.0, 0], "state field 'weights' must not all be zero, got [0.0, 0]"),
        ("initial_weights", [1, "2"], "'initial_weights[1]' must be a real number, got '2'"),
        ("counts", [1, -2], "state field 'counts[1]' must be >= 0, got -2"),
        ("counts", [1, True], "state field 'counts[1]' has type bool, expected int"),
        ("active", [True], "state field 'active' holds 1 items, expected 2 (one per source)"),
        ("active", [True, 1], "state field 'active[1]' has type int, expected bool"),
        ("seed", 5, "seed 5"),
    ]:
        with pytest.raises(StateMismatchError, match=re.escape(message)):
            mixer([1, 1], seed=4).setstate({**state, key: value})


# -- argument errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1, math.nan], r"weights\[1\] must be finite and >= 0, got nan"),
        ([math.inf, 1], r"weights\[0\] must be finite and >= 0, got inf"),
        ([1, -0.5], r"weights\[1\] must be finite and >= 0, got -0.5"),
        ([0, 0.0], r"weights must not all be zero, got \[0, 0.0\]"),
        ([1], r"weights must hold one weight per source \(2\), got 1: \[1\]"),
        ([1, 2, 3], r"weights must hold one weight per source \(2\), got 3"),
        ([1, "2"], r"weights\[1\] must be a real number, got '2'"),
        ([True, 1], r"weights\[0\] must be a real number, got True"),
        ([1, 10**400], r"weights\[1\] must be finite and >= 0"),
        ("12", r"weights must be a sequence of 2 numbers, got '12'"),
        (None, r"weights must be a sequence of 2 numbers, got None"),
    ],
)
def test_bad_weights_raise_a_clear_value_error(weights: Any, message: str) -> None:
    with pytest.raises(ValueError, match=r"^WeightedMultiplexIterator: " + message):
        it.WeightedMultiplexIterator([tagged(0, 3), tagged(1, 3)], weights)
    pipeline = mixer([1, 1])
    with pytest.raises(ValueError, match=r"^WeightedMultiplexIterator.set_weights: " + message):
        pipeline.set_weights(weights)
    assert pipeline.weights == [1.0, 1.0]


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="source_iterators must not be empty"):
        it.WeightedMultiplexIterator([], [])
    with pytest.raises(ValueError, match=r"source_iterators\[1\] must be a CheckpointableIterator"):
        it.WeightedMultiplexIterator([tagged(0, 2), [1, 2]], [1, 1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_on must be one of"):
        mixer([1], stop_on="never")
    with pytest.raises(TypeError, match="seed must be an int, a str or None"):
        mixer([1], seed=1.5)
