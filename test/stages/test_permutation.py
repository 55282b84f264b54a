"""`PermutationSourceIterator`: shuffled indices of map-style data in constant memory.

Every epoch is a permutation of ``range(num_items)``; the orders are uniform as far as
chi-square tests over many seeds can tell; epochs differ; ranks split every epoch into
disjoint, balanced shares that cover it; states are tiny and restore in constant time.

Uniformity: each statistic below is refused when its p-value is below ``ALPHA = 1e-6``.
44 statistics are computed (and 27 for large sizes), so a truly uniform shuffle would
fail these tests with a probability below 1e-4 (union bound); the seeds are fixed, so the outcome is
deterministic. The same checks reject the network with 6 rounds instead of 12 for small
domains (p = 3e-22).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from _profiles import examples
from _waiting import HANG, within
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like._core.protocol import StateMismatchError
from infinibatch_like.iterators import MapIterator, PermutationSourceIterator
from infinibatch_like.stages import permutation

ALPHA = 1e-6
SEEDS = range(2000)
SMALL_SIZES = (2, 3, 5, 8, 10, 17, 64)
"""Sizes whose permutations are enumerated for every seed (powers of two, primes, ...)."""

SPECIAL_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 15, 16, 17, 31, 32, 33, 127, 128, 129, 255, 256,
                 257, 509, 1021, 1023, 1024, 1025, 4093, 4095, 4096, 4097]  # fmt: skip


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square distributed with `dof` degrees of freedom (the
    closed forms of the regularized upper incomplete gamma function at dof / 2)."""
    y = statistic / 2
    if y == 0:
        return 1.0
    if dof % 2 == 0:
        terms = [-y + i * math.log(y) - math.lgamma(i + 1) for i in range(dof // 2)]
        return min(1.0, sum(math.exp(term) for term in terms))
    terms = [-y + (i + 0.5) * math.log(y) - math.lgamma(i + 1.5) for i in range(dof // 2)]
    return min(1.0, math.erfc(math.sqrt(y)) + sum(math.exp(term) for term in terms))


def chi_square_p(counts: list[int]) -> float:
    """The p-value of `counts` against equal expected counts."""
    expected = sum(counts) / len(counts)
    statistic = sum((count - expected) ** 2 / expected for count in counts)
    return chi_square_sf(statistic, len(counts) - 1)


def test_chi_square_sf_matches_known_quantiles() -> None:
    # upper quantiles of the chi-square distribution (standard tables)
    assert chi_square_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi_square_sf(5.991465, 2) == pytest.approx(0.05, rel=1e-5)
    assert chi_square_sf(16.918978, 9) == pytest.approx(0.05, rel=1e-5)
    assert chi_square_sf(23.209251, 10) == pytest.approx(0.01, rel=1e-5)
    assert chi_square_sf(0.0, 4) == 1.0


def epoch_order(size: int, seed: int, epoch: int = 0) -> list[int]:
    """The indices of one epoch, in order, as the source yields them."""
    source = PermutationSourceIterator(size, seed=seed, epochs=epoch + 1)
    return list(itertools.islice(source, epoch * size, (epoch + 1) * size))


def uniformity_p_values(orders: Callable[[int, int], list[int]]) -> dict[str, float]:
    """p-values of the uniformity statistics of the orders ``orders(size, seed)``."""
    p_values: dict[str, float] = {}
    for size in SMALL_SIZES:
        lands = {index: [0] * size for index in {0, size // 2, size - 1}}
        pairs = {pair: 0 for pair in {(0, 1), (0, size - 1), (size // 2 - 1, size // 2)}}
        firsts = Counter[tuple[int, int]]()
        for seed in SEEDS:
            order = orders(size, seed)
            position = {index: place for place, index in enumerate(order)}
            for index, counts in lands.items():
                counts[position[index]] += 1
            for first, second in pairs:
                pairs[first, second] += position[first] < position[second]
            firsts[order[0], order[1]] += 1
        for index, counts in lands.items():
            p_values[f"where index {index} of {size} lands"] = chi_square_p(counts)
        for (first, second), before in pairs.items():
            p_values[f"{first} before {second} of {size}"] = chi_square_p(
                [before, len(SEEDS) - before]
            )
        if size <= 17:  # the first two indices jointly: size * (size - 1) cells
            cells = [firsts[a, b] for a in range(size) for b in range(size) if a != b]
            p_values[f"the first two indices of {size}"] = chi_square_p(cells)
    return p_values


def test_orders_are_uniform_over_seeds() -> None:
    p_values = uniformity_p_values(epoch_order)
    assert len(p_values) == 44
    failed = {name: p for name, p in p_values.items() if p < ALPHA}
    assert not failed, f"non-uniform (p < {ALPHA}): {failed}"


@pytest.mark.parametrize("size", [1000, 2**20 + 1, 10**12])
def test_the_index_at_a_position_is_uniform_over_seeds_for_large_sizes(size: int) -> None:
    for position in (0, size // 2, size - 1):
        bins = [0] * 10
        for seed in SEEDS:
            bins[permutation.IndexPermutation(size, permutation.epoch_key(seed, 0))(position)
                 * 10 // size] += 1  # fmt: skip
        assert chi_square_p(bins) >= ALPHA, (position, bins)


def test_the_checks_reject_a_network_with_too_few_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(permutation, "_ROUNDS_SMALL", 6)  # half the rounds of small domains
    p_values = uniformity_p_values(epoch_order)
    assert p_values["the first two indices of 8"] < ALPHA


@given(
    size=st.one_of(st.sampled_from(SPECIAL_SIZES), st.integers(1, 1500)),
    seed=st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=5)),
    epoch=st.integers(0, 2**40),
)
def test_every_epoch_is_a_permutation(size: int, seed: int | str, epoch: int) -> None:
    index_at = permutation.IndexPermutation(size, permutation.epoch_key(seed, epoch))
    assert sorted(map(index_at, range(size))) == list(range(size))


def test_the_source_yields_the_network_s_epochs_in_turn() -> None:
    indices = list(PermutationSourceIterator(10, seed="a", epochs=3))
    keyed = [permutation.IndexPermutation(10, permutation.epoch_key("a", epoch))
             for epoch in range(3)]  # fmt: skip
    assert indices == [index_at(position) for index_at in keyed for position in range(10)]


def test_epochs_and_seeds_give_different_orders() -> None:
    orders = {tuple(epoch_order(50, seed, epoch)) for seed in range(5) for epoch in range(5)}
    assert len(orders) == 25
    endless = PermutationSourceIterator(50, seed=3)
    assert list(PermutationSourceIterator(50, seed=3, epochs=4)) == list(
        itertools.islice(endless, 200)
    )


@given(size=st.integers(1, 120), world=st.integers(1, 9), epochs=st.integers(1, 3),
       seed=st.integers(0, 2**32))  # fmt: skip
def test_ranks_share_every_epoch_disjointly_and_evenly(
    size: int, world: int, epochs: int, seed: int
) -> None:
    shares: dict[tuple[int, int], list[int]] = {}  # (epoch, rank) -> indices
    for rank in range(world):
        source = PermutationSourceIterator(size, seed=seed, epochs=epochs,
                                           num_instances=world, instance_rank=rank)  # fmt: skip
        while True:
            epoch = source.getstate()["epoch_number"]
            index = next(source, None)
            if index is None:
                break
            shares.setdefault((epoch, rank), []).append(index)
    for epoch in range(epochs):
        parts = [shares.get((epoch, rank), []) for rank in range(world)]
        assert sorted(itertools.chain(*parts)) == list(range(size))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    totals = [sum(len(shares.get((e, rank), [])) for e in range(epochs)) for rank in range(world)]
    assert max(totals) - min(totals) <= 1


def stream_after(state: dict[str, object], n: int, **kwargs: object) -> list[int]:
    source = PermutationSourceIterator(**kwargs)  # type: ignore[arg-type]
    source.setstate(json.loads(json.dumps(state)))
    return list(itertools.islice(source, n))


@settings(max_examples=examples(0.5))
@given(size=st.integers(1, 25), world=st.integers(1, 5), epochs=st.none() | st.integers(1, 3),
       data=st.data())  # fmt: skip
def test_every_state_resumes_the_same_tail(
    size: int, world: int, epochs: int | None, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world - 1))
    kwargs = dict(num_items=size, seed=9, epochs=epochs, num_instances=world, instance_rank=rank)
    source = PermutationSourceIterator(**kwargs)  # type: ignore[arg-type]
    limit = 3 * size + world
    states, items = [], []
    for _ in range(limit):
        states.append(source.getstate())
        item = next(source, None)
        if item is None:
            break
        items.append(item)
    states.append(source.getstate())
    for position, state in enumerate(states):
        tail = items[position:]  # all that is left of a finite stream
        assert stream_after(state, limit if epochs else len(tail), **kwargs) == tail, position


def test_a_state_is_small_and_restores_at_once_however_far() -> None:
    source = PermutationSourceIterator(10**9, seed=5, num_instances=3, instance_rank=1)
    state = source.getstate()
    assert len(json.dumps(state)) < 250
    epoch = 10**15
    state.update(epoch_number=epoch, position=(1 - epoch * 10**9) % 3)  # rank 1's next
    # Walking 10**15 epochs of 10**9 items would never end: any bound tells the two apart.
    assert within(
        HANG,
        lambda: stream_after(state, 3, num_items=10**9, seed=5, num_instances=3, instance_rank=1),
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_items": 0}, ValueError, "num_items must be >= 1, got 0"),
        ({"num_items": 2.0}, TypeError, "num_items must be an int, got 2.0"),
        ({"num_items": True}, TypeError, "num_items must be an int, got True"),
        ({"num_items": 2**64 + 1}, ValueError, f"num_items must be <= 2**64, got {2**64 + 1}"),
        ({"num_items": 5, "epochs": 0}, ValueError, "epochs must be >= 1, got 0"),
        ({"num_items": 5, "epochs": "1"}, TypeError, "epochs must be an int, got '1'"),
        ({"num_items": 5, "num_instances": 2, "instance_rank": 2}, ValueError,
         "instance_rank must be < num_instances (2), got 2"),
        ({"num_items": 5, "seed": 1.5}, TypeError, "seed must be an int, a str or None, got 1.5"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        PermutationSourceIterator(**kwargs)  # type: ignore[arg-type]
    assert str(raised.value) == f"PermutationSourceIterator: {message}"


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"num_items": 11}, "taken with num_items=10, this stage has num_items=11"),
        ({"epochs": 3}, "taken with epochs=2, this stage has epochs=3"),
        ({"epochs": None}, "taken with epochs=2, this stage has epochs=None"),
        ({"num_instances": 3}, "taken with num_instances=2, this stage has num_instances=3"),
        ({"seed": 8}, "the checkpoint was taken with seed 7, this stage has 8"),
    ],
)
def test_a_state_of_another_stream_is_refused_naming_the_argument(
    other: dict[str, object], message: str
) -> None:
    kwargs: dict[str, object] = dict(num_items=10, seed=7, epochs=2, num_instances=2)
    source = PermutationSourceIterator(**kwargs)  # type: ignore[arg-type]
    next(source)
    with pytest.raises(StateMismatchError, match=message):
        stream_after(source.getstate(), 1, **{**kwargs, **other})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position": 10}, "state field 'position' must be >= 0 and < num_items=10, got 10"),
        ({"epoch_number": -1}, "state field 'epoch_number' must be >= 0, got -1"),
        ({"position": 2}, "position 2 does not fit rank 1 of 2"),
        ({"epoch_number": 3}, "position 31 is past the end of the stream"),
    ],
)
def test_a_damaged_state_is_refused(change: dict[str, int], message: str) -> None:
    kwargs: dict[str, object] = dict(num_items=10, seed=7, epochs=2, num_instances=2,
                                     instance_rank=1)  # fmt: skip
    source = PermutationSourceIterator(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(StateMismatchError, match=message):
        stream_after({**source.getstate(), **change}, 1, **kwargs)


def load(files: list[str]) -> Callable[[int], str]:
    return files.__getitem__


def test_with_map_iterator_it_loads_every_file_once_per_epoch() -> None:
    files = [f"file{index}.txt" for index in range(23)]
    loaded: Iterator[str] = MapIterator(PermutationSourceIterator(len(files), seed=1, epochs=2),
                                        load(files))  # fmt: skip
    assert Counter(loaded) == Counter(files * 2)
