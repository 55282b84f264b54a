"""balanced_shards: each chunk in exactly one shard, the same answer everywhere, shards
within one chunk's count of each other, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infinibatch_like.prepare.balancing import balanced_shards

COUNTS = st.lists(st.integers(0, 10_000), max_size=200)
SHARDS = st.integers(1, 40)
REPO = Path(__file__).resolve().parents[2]


def _loads(counts: list[int], shards: list[list[int]]) -> list[int]:
    return [sum(counts[position] for position in shard) for shard in shards]


def test_largest_chunks_first_to_the_emptiest_shard_with_fixed_tie_breaks() -> None:
    # a5 -> 0; b3 -> 1; c3 -> 2; d2 -> 1 (1 and 2 tie at 3: lower number); e2 -> 2;
    # f1 -> 0 (all at 5: fewest chunks); g0 -> 1, h0 -> 2 (tie at 5 and 2 chunks: lower number)
    chunks = [("a", 5), ("b", 3), ("c", 3), ("d", 2), ("e", 2), ("f", 1), ("g", 0), ("h", 0)]
    assert balanced_shards(chunks, 3) == [["a", "f"], ["b", "d", "g"], ["c", "e", "h"]]


def test_stride_imbalance_of_full_chunks_and_remainders_is_evened_out() -> None:
    # inputs of 100 + r items cut into one chunk of 100 and one of r: a stride over 2 shards
    # gives shard 0 every full chunk, shard 1 every remainder
    counts = [count for r in (31, 77, 12, 58, 90, 45, 66, 20) for count in (100, r)]
    assert [sum(counts[shard::2]) for shard in range(2)] == [800, 399]
    shards = balanced_shards(list(enumerate(counts)), 2)
    assert shards == [[0, 1, 4, 7, 8, 9, 12, 15], [2, 3, 5, 6, 10, 11, 13, 14]]
    assert _loads(counts, shards) == [599, 600]


@given(COUNTS, SHARDS)
def test_every_chunk_in_exactly_one_shard_in_input_order(counts: list[int], n: int) -> None:
    shards = balanced_shards(list(enumerate(counts)), n)
    assert len(shards) == n
    assert sorted(position for shard in shards for position in shard) == list(range(len(counts)))
    assert all(shard == sorted(shard) for shard in shards)
    if len(counts) >= n:
        assert all(shards)


@given(COUNTS, SHARDS)
def test_shards_differ_by_at_most_the_largest_chunk(counts: list[int], n: int) -> None:
    loads = _loads(counts, balanced_shards(list(enumerate(counts)), n))
    assert max(loads) - min(loads) <= max(counts, default=0)


@given(COUNTS, SHARDS)
def test_the_same_shards_from_the_same_list_in_any_form(counts: list[int], n: int) -> None:
    chunks = [(f"chunk-{position:04d}", count) for position, count in enumerate(counts)]
    expected = balanced_shards(chunks, n)
    assert balanced_shards(iter(chunks), n) == expected
    assert balanced_shards(json.loads(json.dumps(chunks)), n) == expected  # lists, not tuples


def test_the_same_shards_in_another_interpreter() -> None:
    # hash randomisation or dict order must not decide: another process, another seed
    code = (
        "from infinibatch_like.prepare.balancing import balanced_shards; "
        "print(balanced_shards([(str(i), (i * 7919) % 613) for i in range(500)], 7))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)},
        ).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    chunks = [(str(i), (i * 7919) % 613) for i in range(500)]
    assert outputs == {f"{balanced_shards(chunks, 7)}\n"}


def test_no_chunks_make_empty_shards() -> None:
    assert balanced_shards([], 3) == [[], [], []]


@pytest.mark.parametrize(
    ("chunks", "num_shards", "error", "message"),
    [
        ([("a", 1)], 0, ValueError, "balanced_shards: num_shards must be >= 1, got 0"),
        ([("a", 1)], 2.0, TypeError, "balanced_shards: num_shards must be an int, got 2.0"),
        ([("a", 1), "b"], 2, TypeError, r"chunks\[1\] must be a \(chunk, count\) pair, got 'b'"),
        ([("a", 1, 2)], 2, TypeError, r"chunks\[0\] must be a \(chunk, count\) pair"),
        ([("a", -1)], 2, ValueError, r"the count of chunks\[0\] must be >= 0, got -1"),
        ([("a", 1.5)], 2, TypeError, r"the count of chunks\[0\] must be an int, got 1.5"),
        ([("a", True)], 2, TypeError, r"the count of chunks\[0\] must be an int, got True"),
    ],
)
def test_bad_arguments_are_named(
    chunks: list[object], num_shards: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        balanced_shards(chunks, num_shards)  # type: ignore[arg-type]
