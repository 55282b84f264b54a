"""CountingRandom: the numbers of random.Random, and a draw count that restores them."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like._rng import CountingRandom


@settings(max_examples=200, deadline=None)
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
