"""SelectManyIterator(read_ahead=n): collections read in threads, same items and states."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
from _profiles import examples
from _streams import drain
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like.datasets import chunked_dataset_iterator

READER = "infinibatch_like.SelectManyIterator.reader"


def readers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == READER]


class Chunks:
    """Chunk index -> lines; records which thread read which chunk and when."""

    def __init__(self, sizes: list[int], fail_at: int | None = None) -> None:
        self.sizes, self.fail_at = sizes, fail_at
        self.reads: list[tuple[int, str]] = []

    def __call__(self, index: int) -> list[str]:
        self.reads.append((index, threading.current_thread().name))
        if index == self.fail_at:
            raise OSError(f"chunk {index} is corrupt")
        return [f"{index}.{line}" for line in range(self.sizes[index])]


def flat(source: list[Any], selector: Any, read_ahead: int) -> it.SelectManyIterator:
    return it.SelectManyIterator(
        it.NativeCheckpointableIterator(source), selector, read_ahead=read_ahead
    )


@settings(max_examples=examples(0.6))
@given(
    sizes=st.lists(st.integers(0, 5), max_size=8),
    read_ahead=st.integers(1, 4),
    data=st.data(),
)
def test_same_items_and_states_as_without_read_ahead(
    sizes: list[int], read_ahead: int, data: st.DataObject
) -> None:
    chunks = Chunks(sizes)
    plain, early = flat(list(range(len(sizes))), chunks, 0), flat(
        list(range(len(sizes))), chunks, read_ahead
    )
    states = []
    with plain, early:
        assert plain.getstate() == early.getstate()
        for expected in plain:
            assert next(early) == expected
            assert early.getstate() == plain.getstate()
            states.append(plain.getstate())
        with pytest.raises(StopIteration):
            next(early)
        assert early.getstate() == plain.getstate()
    if states:  # a state from the plain stage restores a read-ahead one, and back
        k = data.draw(st.integers(0, len(states) - 1))
        with flat(list(range(len(sizes))), chunks, read_ahead) as restored:
            restored.setstate(states[k])
            rest = list(restored)
        with flat(list(range(len(sizes))), chunks, 0) as reference:
            reference.setstate(states[k])
            assert rest == list(reference)
    assert not readers()


def test_collections_are_read_ahead_in_threads() -> None:
    chunks = Chunks([3] * 6)
    with flat(list(range(6)), chunks, 2) as pipeline:
        assert next(pipeline) == "0.0"
        read = [index for index, _ in chunks.reads]
        assert read == [0, 1, 2]  # the current chunk and the next two
        assert {name for _, name in chunks.reads} == {READER}
        assert list(pipeline)[-1] == "5.2"
    assert not readers()


def test_a_failing_chunk_raises_where_it_is_reached_and_names_the_chunk() -> None:
    chunks = Chunks([2] * 5, fail_at=3)
    got = []
    with flat(list(range(5)), chunks, 3) as pipeline:
        with pytest.raises(OSError, match="chunk 3 is corrupt") as raised:
            drain(pipeline, got)
        assert got == ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1"]  # nothing lost before it
        if sys.version_info >= (3, 11):
            assert raised.value.__notes__ == [
                "(raised by SelectManyIterator's collection_selector on 3, after 0 of its items)"
            ]
        state = pipeline.getstate()
    chunks.fail_at = None
    with flat(list(range(5)), chunks, 3) as resumed:
        resumed.setstate(state)
        assert list(resumed) == ["3.0", "3.1", "4.0", "4.1"]


def fail_on_two(index: int) -> int:
    if index == 2:
        raise LookupError("source failed")
    return index


def test_a_source_error_comes_after_the_collections_read_before_it() -> None:
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(4))), fail_on_two)
    pipeline = it.SelectManyIterator(source, Chunks([2] * 4), read_ahead=3)
    got = []
    with pytest.raises(LookupError, match="source failed"):
        drain(pipeline, got)
    assert got == ["0.0", "0.1", "1.0", "1.1"]
    pipeline.close()
    assert not readers()


def test_close_waits_for_reads_in_flight() -> None:
    release = threading.Event()

    def slow(index: int) -> list[int]:
        if index > 0:
            release.wait(10)
        return [index]

    pipeline = flat(list(range(10)), slow, 4)
    assert next(pipeline) == 0
    assert len(readers()) == 4  # chunks 1 to 4, waiting
    timer = threading.Timer(0.2, release.set)
    timer.start()
    pipeline.close()
    assert release.is_set()
    assert not readers()
    timer.join()
    with pytest.raises(RuntimeError, match="closed"):
        next(pipeline)


def test_a_negative_read_ahead_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="SelectManyIterator: read_ahead must be >= 0, got -1"):
        flat([1], None, -1)


def test_chunked_dataset_iterator_reads_ahead() -> None:
    chunks = Chunks([4] * 8)
    kwargs: dict[str, Any] = {"buffer_size": 5, "seed": 3}
    with chunked_dataset_iterator(list(range(8)), chunks, read_ahead_chunks=2, **kwargs) as early:
        got = [next(early) for _ in range(40)]
        state = early.getstate()
        after = [next(early) for _ in range(10)]
    with chunked_dataset_iterator(list(range(8)), chunks, **kwargs) as plain:
        assert [next(plain) for _ in range(40)] == got
    kwargs["read_ahead_chunks"] = 2
    with chunked_dataset_iterator(list(range(8)), chunks, **kwargs) as restored:
        restored.setstate(state)
        assert [next(restored) for _ in range(10)] == after
    assert {name for _, name in chunks.reads} >= {READER}
