"""CountingRandom: the numbers of random.Random, and a position that restores them."""

from __future__ import annotations

import json
import random

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like._core.rng import REDRAW_LIMIT, CountingRandom, mark_fields, read_mark
from infinibatch_like.stages.sources import RandomIterator


@settings(max_examples=examples(2))
@given(
    seed=st.integers(0, 2**64),
    bounds=st.lists(st.integers(1, 2**200), min_size=1, max_size=12),
    length=st.integers(0, 40),
)
def test_below_and_shuffle_match_random_and_count_every_word(
    seed: int, bounds: list[int], length: int
) -> None:
    reference, counted = random.Random(seed), CountingRandom(seed)
    for n in bounds:  # bounds above 2**32 take several words per draw
        assert counted.below(n) == reference.randrange(n)
    items, expected = list(range(length)), list(range(length))
    counted.shuffle(items)
    reference.shuffle(expected)
    assert items == expected
    jumped = CountingRandom.at(seed, counted.draws)
    assert jumped.getstate() == counted.getstate()
    assert jumped.below(2**70) == counted.below(2**70)


def test_a_position_beyond_the_redraw_limit_is_stored_packed_and_restored_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = "long run"
    rng = CountingRandom.at(seed, REDRAW_LIMIT + 3)
    fields = json.loads(json.dumps(mark_fields(rng.mark())))
    assert fields["draws"] == REDRAW_LIMIT + 3
    assert isinstance(fields["generator"], str)
    assert len(fields["generator"]) < 3_400
    stage = RandomIterator(0)
    monkeypatch.setattr(CountingRandom, "at", None)  # a restore must not redraw
    restored = CountingRandom.from_mark(seed, read_mark(stage, **fields))
    assert restored.draws == rng.draws
    assert [restored.random() for _ in range(5)] == [rng.random() for _ in range(5)]
    assert restored.draws == rng.draws


def test_short_positions_are_stored_as_counts_only() -> None:
    rng = CountingRandom.at(3, REDRAW_LIMIT)
    assert mark_fields(rng.mark()) == {"draws": REDRAW_LIMIT, "generator": None}
