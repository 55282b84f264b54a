"""Errors say where they come from: the chunk being read, the stage and parameter of the
user callable that raised; a corpus with no items is refused instead of spinning."""

from __future__ import annotations

import functools
import gzip
import sys
from collections.abc import Iterator
from itertools import islice
from math import gcd
from pathlib import Path
from typing import Any

import numpy
import pytest
from _items import failing
from _profiles import examples
from _streams import drain, native
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infinibatch.datasets import chunked_dataset_iterator as infinibatch_chunked

import infinibatch_like.iterators as it
from infinibatch_like._core.stage import fast_iterator
from infinibatch_like.datasets import chunked_dataset_iterator

needs_notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="notes print from 3.11")


def notes(error: BaseException) -> list[str]:
    return list(getattr(error, "__notes__", []))


# -- reading errors name the chunk ---------------------------------------------------------


def write_gzip_chunks(folder: Path, count: int, lines: int) -> list[str]:
    paths = []
    for chunk in range(count):
        path = folder / f"part-{chunk:05d}.txt.gz"
        with gzip.open(path, "wt") as file:
            for line in range(lines):
                file.write(f"{chunk}:{line} {'x' * (line % 40)}\n")
        paths.append(str(path))
    return paths


def read_gzip_lines(path: str) -> Iterator[str]:
    """A lazy reader, as users write them: the file is read while the lines are used."""
    with gzip.open(path, "rt") as file:
        for line in file:
            yield line.rstrip("\n")


@needs_notes
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_truncated_gzip_chunk_is_named_and_nothing_is_lost(
    tmp_path: Path, read_ahead: int
) -> None:
    paths = write_gzip_chunks(tmp_path, 3, 3000)
    whole = Path(paths[1]).read_bytes()
    Path(paths[1]).write_bytes(whole[: len(whole) // 2])
    readable: list[str] = []  # what a plain loop reads from the truncated file before the error
    with pytest.raises(EOFError):
        readable.extend(read_gzip_lines(paths[1]))
    assert 0 < len(readable) < 3000

    def build() -> it.CheckpointableIterator[str]:
        return chunked_dataset_iterator(
            paths, read_gzip_lines, 100, train=False, shuffle=False, read_ahead_chunks=read_ahead
        )

    got: list[str] = []
    pipeline = build()
    with pytest.raises(EOFError, match="end-of-stream marker") as raised:
        got.extend(pipeline)
    expected_note = (
        f"(raised by chunked_dataset_iterator's read_chunk_fn on {paths[1]!r}, "
        f"after {len(readable)} of its items)"
    )
    assert notes(raised.value) == [expected_note]
    assert got == list(read_gzip_lines(paths[0])) + readable  # every item before the error
    state = pipeline.getstate()
    pipeline.close()

    with build() as restored:  # the same place again: nothing skipped
        restored.setstate(state)
        with pytest.raises(EOFError) as again:
            next(restored)
        assert notes(again.value) == [expected_note]
    Path(paths[1]).write_bytes(whole)  # repaired: the restore continues right after `got`
    with build() as restored:
        restored.setstate(state)
        rest = list(restored)
    assert got + rest == [line for path in paths for line in read_gzip_lines(path)]


class ReadError(Exception):
    pass


def lines_failing_after(count: int) -> Any:
    def read(chunk: int) -> Iterator[str]:
        for line in range(5):
            if chunk == 2 and line == count:
                raise ReadError(f"chunk {chunk} line {line}")
            yield f"{chunk}.{line}"

    return read


@needs_notes
@pytest.mark.parametrize("read_ahead", [0, 1, 3])
@pytest.mark.parametrize("fail_after", [0, 3])
def test_error_while_iterating_a_collection_names_the_item(
    read_ahead: int, fail_after: int
) -> None:
    def build() -> it.SelectManyIterator:
        return it.SelectManyIterator(
            native(range(4)), lines_failing_after(fail_after), read_ahead=read_ahead
        )

    pipeline = build()
    got: list[str] = []
    with pytest.raises(ReadError) as raised:
        got.extend(pipeline)
    assert notes(raised.value) == [
        f"(raised by SelectManyIterator's collection_selector on 2, after {fail_after} of its "
        "items)"
    ]
    assert got == [f"{chunk}.{line}" for chunk in range(2) for line in range(5)] + [
        f"2.{line}" for line in range(fail_after)
    ]
    state = pipeline.getstate()
    assert state["consumed"] == fail_after
    restored = build()
    restored.setstate(state)
    with pytest.raises(ReadError, match="chunk 2 line"):
        next(restored)


@needs_notes
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_error_of_read_chunk_fn_itself_names_the_chunk(read_ahead: int) -> None:
    def read(chunk: str) -> list[str]:
        if chunk == "b.txt":
            raise FileNotFoundError(2, "No such file", chunk)
        return [chunk + "!"]

    pipeline = chunked_dataset_iterator(
        ["a.txt", "b.txt"], read, 4, train=False, shuffle=False, read_ahead_chunks=read_ahead
    )
    assert next(pipeline) == "a.txt!"
    with pytest.raises(FileNotFoundError) as raised:
        next(pipeline)
    assert notes(raised.value) == [
        "(raised by chunked_dataset_iterator's read_chunk_fn on 'b.txt', after 0 of its items)"
    ]


# -- str collections, chunked_dataset_iterator's arguments ---------------------------------


@pytest.mark.parametrize("returned", ["line one\nline two", b"bytes"])
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_read_chunk_fn_returning_a_str_is_refused(returned: Any, read_ahead: int) -> None:
    pipeline = chunked_dataset_iterator(
        ["c.txt"], lambda _: returned, 4, train=False, shuffle=False, read_ahead_chunks=read_ahead
    )
    kind = type(returned).__name__
    with pytest.raises(TypeError) as raised:
        next(pipeline)
    assert str(raised.value).startswith(
        f"chunked_dataset_iterator's read_chunk_fn returned a {kind} for 'c.txt': it must "
        "return an iterable of items"
    )


def test_selector_returning_a_str_is_refused_but_str_items_are_iterated() -> None:
    with pytest.raises(
        TypeError, match="SelectManyIterator's collection_selector returned a str for 'ab'"
    ):
        next(it.SelectManyIterator(native(["ab"]), lambda item: item))
    assert list(it.SelectManyIterator(native(["ab", "c"]))) == ["a", "b", "c"]  # infinibatch's


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        (([], list, 4), ValueError, "chunked_dataset_iterator: chunk_refs is empty"),
        (("data/*.gz", list, 4), TypeError,
         "chunked_dataset_iterator: chunk_refs must be a sequence of chunk references"),
        ((iter(["a"]), list, 4), TypeError,
         "chunked_dataset_iterator: chunk_refs must be a sequence of chunk references"),
        ((["a"], None, 4), TypeError,
         "chunked_dataset_iterator: read_chunk_fn must be callable, got None"),
        ((["a"], list, "4"), TypeError,
         "chunked_dataset_iterator: buffer_size must be an int, got '4'"),
        ((["a"], list, 0), ValueError, "chunked_dataset_iterator: buffer_size must be >= 1, got 0"),
        ((["a"], list, 4, True, 1.5), TypeError,
         "chunked_dataset_iterator: seed must be an int or None, got 1.5"),
        ((["a"], list, 4, True, 1, True, False, "upper"), TypeError,
         "chunked_dataset_iterator: transform must be callable, got 'upper'"),
        ((["a"], list, 4, True, 1, True, False, None, False, 2, 2), ValueError,
         "chunked_dataset_iterator: instance_rank must be < num_instances (2), got 2"),
        ((["a"], list, 4, True, 1, True, False, None, False, "2"), TypeError,
         "chunked_dataset_iterator: num_instances must be an int, got '2'"),
    ],
)
def test_chunked_dataset_iterator_names_its_bad_argument(
    arguments: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        chunked_dataset_iterator(*arguments)
    assert str(raised.value).startswith(message)


def test_unused_buffer_size_and_an_empty_evaluation_list_stay_accepted() -> None:
    assert list(chunked_dataset_iterator([], list, None, train=False, shuffle=False)) == []  # type: ignore[arg-type]
    pipeline = chunked_dataset_iterator([[1, 2]], list, 0, train=False, shuffle=False)
    assert list(pipeline) == [1, 2]
    with pytest.raises(TypeError, match="read_ahead_chunks must be an int"):
        chunked_dataset_iterator(["a"], list, 4, read_ahead_chunks=None)  # type: ignore[arg-type]


# -- a corpus with no items ----------------------------------------------------------------


class Chunks:
    """read_chunk_fn over chunks of the given sizes; fails the test if it is called so
    often that the pipeline must be spinning."""

    def __init__(self, sizes: list[int], limit: int = 20_000) -> None:
        self.sizes, self.calls, self.limit = sizes, 0, limit

    def __call__(self, chunk: int) -> list[str]:
        self.calls += 1
        if self.calls > self.limit:
            raise AssertionError("the pipeline keeps reading empty chunks: it spins")
        return [f"{chunk}.{line}" for line in range(self.sizes[chunk])]


@pytest.mark.parametrize("refs", [list, tuple, numpy.array])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_corpus_of_empty_chunks_is_refused(shuffle: bool, refs: Any) -> None:
    pipeline = chunked_dataset_iterator(refs(range(5)), Chunks([0] * 5), 8, seed=1, shuffle=shuffle)
    with pytest.raises(ValueError, match="no items") as raised:
        next(pipeline)
    assert str(raised.value) == (
        "chunked_dataset_iterator: all 5 chunks in chunk_refs are empty: read_chunk_fn "
        "returned no items for any of them, so there are no items to train on"
    )


def test_a_rank_whose_strided_chunks_are_empty_is_named() -> None:
    sizes = [0, 1, 0, 1, 0, 1]  # shuffle=False, 2 ranks: rank 0 reads chunks 0, 2, 4
    rank0 = chunked_dataset_iterator(
        list(range(6)), Chunks(sizes), 8, seed=1, shuffle=False, num_instances=2
    )
    with pytest.raises(ValueError, match="no items") as raised:
        next(rank0)
    assert str(raised.value).startswith(
        "chunked_dataset_iterator: the chunks of rank 0 of 2 are all empty (with "
        "shuffle=False this rank reads the 3 chunks at indices 0, 2, ... of chunk_refs)"
    )
    rank1 = chunked_dataset_iterator(
        list(range(6)), Chunks(sizes), 8, seed=1, shuffle=False, num_instances=2, instance_rank=1
    )
    assert [next(rank1) for _ in range(4)] == ["1.0", "3.0", "5.0", "1.0"]


def test_evaluation_over_empty_chunks_just_ends() -> None:
    pipeline = chunked_dataset_iterator(
        list(range(4)), Chunks([0] * 4), 8, train=False, shuffle=False
    )
    assert list(pipeline) == []


@settings(max_examples=examples(1.2), suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=1, max_size=9),
    num_instances=st.integers(1, 4),
    data=st.data(),
    shuffle=st.booleans(),
    seed=st.integers(0, 3),
)
def test_no_items_is_raised_iff_the_rank_can_never_get_one(
    sizes: list[int], num_instances: int, data: st.DataObject, shuffle: bool, seed: int
) -> None:
    rank = data.draw(st.integers(0, num_instances - 1))
    stride = 1 if shuffle else gcd(num_instances, len(sizes))
    reachable = [sizes[index] for index in range(rank % stride, len(sizes), stride)]
    arguments: dict[str, Any] = dict(
        buffer_size=3, seed=seed, shuffle=shuffle, num_instances=num_instances, instance_rank=rank
    )
    pipeline = chunked_dataset_iterator(list(range(len(sizes))), Chunks(sizes), **arguments)
    if not any(reachable):
        with pytest.raises(ValueError, match=r"(are all empty|are empty).*no items to train on"):
            next(pipeline)
        return
    oracle = infinibatch_chunked(list(range(len(sizes))), Chunks(sizes), **arguments)
    assert [next(pipeline) for _ in range(12)] == [next(oracle) for _ in range(12)]


# -- notes naming the stage whose user callable raised -------------------------------------


class Scaler:
    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, x: int) -> float:
        return self.factor / (x - 3)

    def scale(self, x: int) -> float:
        return self.factor / (x - 3)


def batch_size_of_readme(longest: str) -> int:
    return 8192 // len(longest)


@needs_notes
@pytest.mark.parametrize(
    ("build", "error", "note"),
    [
        (lambda: it.MapIterator(native(range(9)), failing), KeyError,
         "(raised by MapIterator's transform failing on item 3)"),
        (lambda: it.FixedBatchIterator(
            it.MapIterator(it.MapIterator(native(range(9)), failing), str), 2), KeyError,
         "(raised by MapIterator's transform failing on item 3)"),
        (lambda: it.MapIterator(native(["a", 3]), str.upper), TypeError,
         "(raised by MapIterator's transform str.upper)"),
        (lambda: it.MapIterator(native(range(9)), Scaler(2)), ZeroDivisionError,
         "(raised by MapIterator's transform Scaler on item 3)"),
        (lambda: it.MapIterator(native(range(9)), Scaler(2).scale), ZeroDivisionError,
         "(raised by MapIterator's transform Scaler.scale on item 3)"),
        (lambda: it.MapIterator(native(range(9)), functools.partial(divmod, 1)),
         ZeroDivisionError, "(raised by MapIterator's transform partial(divmod))"),
        (lambda: it.MapIterator(it.MapIterator(native(range(9)), failing), failing), KeyError,
         "(raised by MapIterator's transform failing, used by 2 stages, on item 3)"),
        (lambda: it.BlockwiseShuffleIterator(it.MapIterator(native(range(9)), failing), 4),
         KeyError, "(raised by MapIterator's transform failing on item 3)"),
        (lambda: it.SamplingRandomMapIterator(
            native(range(9)), lambda rng, x: failing(x), seed=1), KeyError,
         "(raised by SamplingRandomMapIterator's transform <lambda> on item 3)"),
        (lambda: it.RecurrentIterator(native(range(9)), lambda state, x: (state, failing(x))),
         KeyError, "(raised by RecurrentIterator's step_function <lambda> on item 3)"),
        (lambda: it.BucketedReadaheadBatchIterator(
            native(["ab", "c", "", ""]), 2, len, batch_size_of_readme), ZeroDivisionError,
         "(raised by BucketedReadaheadBatchIterator's batch_size batch_size_of_readme "
         "on item '')"),
        (lambda: it.BucketedReadaheadBatchIterator(
            native([1, 2, 3, 4]), 4, failing, 2, shuffle=False), KeyError,
         "(raised by BucketedReadaheadBatchIterator's key failing on item 3)"),
        (lambda: it.BucketedReadaheadBatchIterator(
            native([1, 2, 3, 4]), 4, None, 2, boundary_key=failing), KeyError,
         "(raised by BucketedReadaheadBatchIterator's boundary_key failing on item 3)"),
        (lambda: it.SelectManyIterator(native(range(5)), lambda x: [failing(x)]), KeyError,
         "(raised by SelectManyIterator's collection_selector on 3, after 0 of its items)"),
    ],
)
def test_error_in_a_user_callable_names_the_stage_once(build: Any, error: type, note: str) -> None:
    pipeline = build()
    with pytest.raises(error) as raised:
        list(pipeline)
    assert notes(raised.value) == [note]


@needs_notes
def test_an_error_of_the_source_data_gets_no_callable_note() -> None:
    class Broken:
        def __iter__(self) -> Iterator[str]:
            yield "a"
            raise ValueError("broken iterable")

    pipeline = it.MapIterator(it.NativeCheckpointableIterator(Broken()), str.upper)
    with pytest.raises(ValueError, match="broken iterable") as raised:
        list(pipeline)
    assert notes(raised.value) == []


def test_callable_note_works_on_any_pipeline_and_error() -> None:
    """As a background worker uses it: on an error caught while pulling items directly."""
    from infinibatch_like._core.notes import callable_note

    pipeline = it.BlockwiseShuffleIterator(it.MapIterator(native(range(9)), failing), 4)
    with pytest.raises(KeyError) as raised:
        list(fast_iterator(pipeline))
    assert callable_note(pipeline, raised.value) == (
        "(raised by MapIterator's transform failing on item 3)"
    )
    assert callable_note(pipeline, ValueError("not raised by the pipeline")) is None
    assert callable_note(object(), raised.value) is None


# -- no item is lost after an error in a transform -----------------------------------------


def fails_at_37(x: int) -> int:
    if x == 37:
        raise ValueError("item 37")
    return x


class FailsOnce:
    """A transform that fails on one item until `repaired` (a bad record, then fixed)."""

    def __init__(self, bad: int = 37) -> None:
        self.bad, self.repaired = bad, False

    def __call__(self, x: Any) -> Any:
        if x == self.bad and not self.repaired:
            raise ValueError(f"item {x}")
        return x


def over_blocks(transform: Any) -> it.CheckpointableIterator[Any]:
    return it.MapIterator(it.BlockwiseShuffleIterator(native(range(50)), 8, seed=1), transform)


def over_chunks(transform: Any) -> it.CheckpointableIterator[Any]:
    chunks = native([range(start, start + 10) for start in range(0, 50, 10)])
    return it.MapIterator(it.SelectManyIterator(chunks), transform)


def chunked(transform: Any) -> it.CheckpointableIterator[Any]:
    return chunked_dataset_iterator(
        [range(start, start + 10) for start in range(0, 50, 10)], list, 8, seed=2,
        transform=transform,
    )


REATTEMPTING = {
    "map": lambda t: it.MapIterator(native(range(50)), t),
    "map-of-map": lambda t: it.MapIterator(it.MapIterator(native(range(50)), t), str),
    "map-in-batches": lambda t: it.FixedBatchIterator(it.MapIterator(native(range(50)), t), 1),
    "map-over-blocks": over_blocks,
    "map-over-chunks": over_chunks,
    "chunked-transform": chunked,
    "recurrent": lambda t: it.RecurrentIterator(native(range(50)), lambda s, x: (s + 1, t(x)), 0),
}


@pytest.mark.parametrize("build", REATTEMPTING.values(), ids=REATTEMPTING.keys())
def test_state_after_a_failed_transform_re_attempts_the_item(build: Any) -> None:
    transform = FailsOnce()
    transform.repaired = True
    uninterrupted = list(islice(build(transform), 60))
    transform = FailsOnce()
    pipeline = build(transform)
    got: list[Any] = []
    with pytest.raises(ValueError, match="item 37"):
        drain(pipeline, got, until=60)
    state = pipeline.getstate()  # points at the failing item: nothing skipped
    restored = build(transform)
    restored.setstate(state)
    assert restored.getstate() == state
    with pytest.raises(ValueError, match="item 37"):
        next(restored)
    transform.repaired = True  # the record is fixed: the stream goes on exactly
    repaired = build(transform)
    repaired.setstate(state)
    got.extend(islice(repaired, 60 - len(got)))
    assert got == uninterrupted


@settings(max_examples=examples(1.5))
@given(
    length=st.integers(1, 40),
    size=st.integers(1, 7),
    over=st.sampled_from(["blocks", "buckets", "chunks", "list"]),
    data=st.data(),
)
def test_any_failed_transform_is_re_attempted_over_sources_that_step_back(
    length: int, size: int, over: str, data: st.DataObject
) -> None:
    bad = data.draw(st.integers(0, length - 1))

    def build(transform: FailsOnce) -> it.CheckpointableIterator[Any]:
        items = native(range(length))
        source: it.CheckpointableIterator[Any] = items
        if over == "blocks":
            source = it.BlockwiseShuffleIterator(items, size, seed=3)
        elif over == "buckets":
            batches = it.BucketedReadaheadBatchIterator(items, size, None, 2, seed=3)
            source = it.MapIterator(batches, sum)
        elif over == "chunks":
            starts = range(0, length, size)
            source = it.SelectManyIterator(
                native([range(start, min(start + size, length)) for start in starts])
            )
        return it.MapIterator(source, transform)

    repaired = FailsOnce(bad)
    repaired.repaired = True
    expected = list(build(repaired))
    transform = FailsOnce(bad)
    pipeline = build(transform)
    got: list[Any] = []
    if bad not in expected:  # a sum of a batch: the bad value may never reach the transform
        return
    with pytest.raises(ValueError, match=f"item {bad}"):
        drain(pipeline, got, until=length)
    state = pipeline.getstate()
    transform.repaired = True
    restored = build(transform)
    restored.setstate(state)
    assert got + list(restored) == expected


@pytest.mark.parametrize(
    "build",
    [
        lambda: it.SamplingRandomMapIterator(native(range(50)), lambda rng, x: fails_at_37(x)),
        lambda: it.MapIterator(it.InfinitePermutationSourceIterator(list(range(50))), fails_at_37),
    ],
    ids=["sampling-map", "map-over-a-source-that-cannot-step-back"],
)
def test_getstate_refuses_the_undefined_position_after_a_failed_transform(build: Any) -> None:
    pipeline = build()
    next(pipeline)
    before = pipeline.getstate()
    got = [next(pipeline) for _ in range(36)]
    with pytest.raises(ValueError, match="item 37"):
        drain(pipeline, got, until=100)
    with pytest.raises(RuntimeError) as raised:
        pipeline.getstate()
    assert "the item it was given is consumed from the source and not yielded" in str(
        raised.value
    )
    assert "Restore a checkpoint taken before the error" in str(raised.value)
    pipeline.setstate(before)  # which re-attempts item 37: nothing skipped
    assert [next(pipeline) for _ in range(len(got))] == got
    with pytest.raises(ValueError, match="item 37"):
        next(pipeline)


def test_state_after_an_error_in_a_batching_callable_re_raises_there() -> None:
    def build() -> it.BucketedReadaheadBatchIterator[str]:
        items = ["aa", "b", "cc", "", "", ""]
        return it.BucketedReadaheadBatchIterator(native(items), 3, len, batch_size_of_readme)

    pipeline = build()
    assert next(pipeline) == ["aa", "cc", "b"]
    with pytest.raises(ZeroDivisionError):
        next(pipeline)
    state = pipeline.getstate()  # defined: the window is re-read from the source
    restored = build()
    restored.setstate(state)
    with pytest.raises(ZeroDivisionError):
        next(restored)



@pytest.mark.parametrize("shuffle", [True, False])
def test_a_few_non_empty_chunks_among_many_empty_ones_reach_every_rank_that_can_read_them(
    shuffle: bool,
) -> None:
    sizes = [0] * 60
    sizes[41] = 2  # with shuffle=False and 4 ranks, only rank 1 (41 % 4) ever reads it
    for rank in range(4):
        arguments: dict[str, Any] = dict(
            buffer_size=2, seed=5, shuffle=shuffle, num_instances=4, instance_rank=rank
        )
        pipeline = chunked_dataset_iterator(list(range(60)), Chunks(sizes), **arguments)
        if shuffle or rank == 1:
            oracle = infinibatch_chunked(list(range(60)), Chunks(sizes), **arguments)
            assert [next(pipeline) for _ in range(5)] == [next(oracle) for _ in range(5)]
        else:
            with pytest.raises(ValueError, match=f"the chunks of rank {rank} of 4 are all empty"):
                next(pipeline)


def test_an_empty_corpus_is_refused_from_a_prefetching_worker_too() -> None:
    with chunked_dataset_iterator(
        list(range(3)), empty_chunk, 4, seed=1, prefetch=True
    ) as pipeline, pytest.raises(ValueError, match="all 3 chunks in chunk_refs are empty"):
        next(pipeline)


def empty_chunk(chunk: int) -> list[str]:
    return []


def test_a_batch_interrupted_by_an_error_is_not_skipped_by_a_later_state() -> None:
    def build() -> it.FixedBatchIterator[str]:
        return it.FixedBatchIterator(
            it.SelectManyIterator(native(range(4)), lines_failing_after(3)), 4
        )

    pipeline = build()
    batches = [next(pipeline) for _ in range(3)]  # chunks 0 and 1, then 2.0 and 2.1
    before = pipeline.getstate()
    with pytest.raises(ReadError):
        next(pipeline)  # after 2.2, the batch's only item so far
    with pytest.raises(RuntimeError, match="interrupted a batch after 1 items"):
        pipeline.getstate()
    restored = build()
    restored.setstate(before)
    with pytest.raises(ReadError):
        next(restored)
    assert batches[2] == ["1.3", "1.4", "2.0", "2.1"]


@needs_notes
def test_a_long_chunk_path_keeps_its_file_name_in_the_note() -> None:
    path = "/mnt/storage/" + "deep/" * 60 + "part-00042.txt.gz"

    def read(chunk: str) -> list[str]:
        raise OSError("unreadable")

    with pytest.raises(OSError, match="unreadable") as raised:
        next(it.SelectManyIterator(native([path]), read))
    (note,) = notes(raised.value)
    assert note.startswith("(raised by SelectManyIterator's collection_selector on '/mnt/storage/")
    assert "part-00042.txt.gz', after 0 of its items)" in note
    assert len(note) < 320
