"""`chunked_dataset_iterator(..., epochs=n)`: n shuffled passes, then the end.

What is identical to the endless stream (same arguments, epochs=None): the chunk sequence
of every rank (its first chunks) and every item but the last at most `buffer_size` (the
last, shorter shuffle block, or the windowed buffer emptied at the end). Over all ranks,
the items are exactly n copies of the corpus. States restore exactly at every point,
including at and after the end, and a state of another `epochs` is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from _profiles import examples
from _streams import take
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like._core.protocol import CheckpointableIterator, StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.stages.sources import create_source_iterator

Corpus = list[list[str]]


def corpus_of(sizes: list[int]) -> Corpus:
    return [[f"c{chunk}-{index}" for index in range(size)] for chunk, size in enumerate(sizes)]


def pipeline(corpus: Corpus, **kwargs: Any) -> CheckpointableIterator[Any]:
    return chunked_dataset_iterator(list(range(len(corpus))), corpus.__getitem__, **kwargs)


def suffix(item: str) -> str:
    return item + "!"


# Strategies of the arguments both property tests draw.
STREAMS = dict(
    buffer_size=st.integers(1, 9),
    seed=st.integers(0, 2**32),
    epochs=st.integers(1, 3),
    world=st.integers(1, 5),
    use_windowed=st.booleans(),
    data=st.data(),
)


@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=7),
    shuffle=st.booleans(),
    read_ahead_chunks=st.sampled_from([0, 2]),
    transform=st.sampled_from([None, suffix]),
    **STREAMS,
)
def test_all_ranks_together_read_the_corpus_epochs_times_and_resume_anywhere(
    sizes: list[int],
    buffer_size: int,
    seed: int,
    epochs: int,
    world: int,
    shuffle: bool,
    use_windowed: bool,
    read_ahead_chunks: int,
    transform: Callable[[str], str] | None,
    data: st.DataObject,
) -> None:
    corpus = corpus_of(sizes)
    kwargs = dict(
        buffer_size=buffer_size, seed=seed, shuffle=shuffle, use_windowed=use_windowed,
        read_ahead_chunks=read_ahead_chunks, transform=transform, epochs=epochs,
        num_instances=world,
    )  # fmt: skip

    def build(rank: int) -> CheckpointableIterator[Any]:
        return pipeline(corpus, instance_rank=rank, **kwargs)

    streams = [list(build(rank)) for rank in range(world)]
    expected = Counter(item for chunk in corpus for item in chunk)
    if transform is not None:
        expected = Counter({transform(item): count for item, count in expected.items()})
    union = Counter(item for stream in streams for item in stream)
    assert union == Counter({item: count * epochs for item, count in expected.items()})

    rank = data.draw(st.integers(0, world - 1), label="rank")
    stream, states = streams[rank], []
    run = build(rank)
    for item in stream:
        states.append(json.loads(json.dumps(run.getstate())))
        assert next(run) == item
    states.append(json.loads(json.dumps(run.getstate())))
    assert take(run, 1) == []  # the end is sticky
    states.append(run.getstate())
    for position, state in enumerate(states):
        fresh = build(rank)
        fresh.setstate(state)
        assert list(fresh) == stream[position:], f"restored at item {position}"


@settings(max_examples=examples(0.6))
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=7), **STREAMS)  # endless: no empties
def test_the_stream_is_the_endless_one_but_for_its_last_shuffle_buffer(
    sizes: list[int],
    buffer_size: int,
    seed: int,
    epochs: int,
    world: int,
    use_windowed: bool,
    data: st.DataObject,
) -> None:
    corpus = corpus_of(sizes)
    rank = data.draw(st.integers(0, world - 1), label="rank")
    kwargs = dict(
        buffer_size=buffer_size, seed=seed, use_windowed=use_windowed, num_instances=world,
        instance_rank=rank,
    )  # fmt: skip
    finite = list(pipeline(corpus, epochs=epochs, **kwargs))
    endless = take(pipeline(corpus, **kwargs), len(finite) + buffer_size)

    # the chunks: the first ones of this rank's endless sequence
    length = len(corpus)
    chunk_count = len(range(rank, epochs * length, world))
    source = it.InfinitePermutationSourceIterator(
        list(range(length)), seed=seed, num_instances=world, instance_rank=rank
    )
    chunks = take(source, chunk_count)
    assert list(create_source_iterator(list(range(length)), seed=seed, num_instances=world,
                                       instance_rank=rank, epochs=epochs)) == chunks
    assert Counter(finite) == Counter(item for chunk in chunks for item in corpus[chunk])

    # the items: identical up to the last buffer's worth
    if use_windowed:
        same = max(0, len(finite) - buffer_size)
    else:
        same = len(finite) - len(finite) % buffer_size
    assert finite[:same] == endless[:same]


def test_epochs_with_one_rank_is_n_full_shuffled_passes() -> None:
    corpus = corpus_of([3, 1, 4, 1, 5])
    items = list(pipeline(corpus, buffer_size=4, seed=7, epochs=3))
    assert Counter(items) == Counter({item: 3 for chunk in corpus for item in chunk})
    chunks = list(create_source_iterator(list(range(5)), seed=7, epochs=3))
    passes = [chunks[i : i + 5] for i in range(0, 15, 5)]
    assert all(sorted(p) == list(range(5)) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # a fresh permutation per pass


def test_the_end_state_restores_to_the_end() -> None:
    corpus = corpus_of([2, 3, 2])
    run = pipeline(corpus, buffer_size=3, seed=1, epochs=2, num_instances=2, instance_rank=1)
    items = list(run)
    end = run.getstate()
    assert end["source"]["source"]["position"] == 7  # rank 1's first position past 2 x 3
    fresh = pipeline(corpus, buffer_size=3, seed=1, epochs=2, num_instances=2, instance_rank=1)
    fresh.setstate(end)
    assert list(fresh) == []
    assert fresh.getstate() == end
    fresh.setstate(None)
    assert list(fresh) == items


def test_a_rank_with_no_chunk_in_any_epoch_ends_at_once() -> None:
    corpus = corpus_of([2, 3])
    run = pipeline(corpus, buffer_size=3, seed=1, epochs=1, num_instances=4, instance_rank=3)
    assert list(run) == []
    state = run.getstate()
    assert state["source"]["source"]["position"] == 3
    other = pipeline(corpus, buffer_size=3, seed=1, epochs=1, num_instances=4, instance_rank=3)
    other.setstate(state)
    assert list(other) == []


def test_empty_chunks_end_an_epochs_stream_instead_of_raising() -> None:
    corpus = corpus_of([0, 0, 0])
    assert list(pipeline(corpus, buffer_size=2, seed=1, epochs=2)) == []
    with pytest.raises(ValueError, match="all 3 chunks in chunk_refs are empty"):
        take(pipeline(corpus, buffer_size=2, seed=1), 1)


@pytest.mark.parametrize(
    ("epochs", "error", "message"),
    [
        (0, ValueError, "chunked_dataset_iterator: epochs must be >= 1, got 0"),
        (-2, ValueError, "chunked_dataset_iterator: epochs must be >= 1, got -2"),
        (1.5, TypeError, "chunked_dataset_iterator: epochs must be an int, got 1.5"),
        ("2", TypeError, "chunked_dataset_iterator: epochs must be an int, got '2'"),
        (True, TypeError, "chunked_dataset_iterator: epochs must be an int, got True"),
    ],
)
def test_a_bad_epochs_is_named(epochs: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as raised:
        pipeline(corpus_of([2]), buffer_size=2, seed=1, epochs=epochs)
    assert str(raised.value) == message


def test_epochs_is_refused_in_evaluation() -> None:
    with pytest.raises(ValueError, match="epochs applies to training") as raised:
        pipeline(corpus_of([2]), buffer_size=2, train=False, shuffle=False, epochs=1)
    assert str(raised.value) == (
        "chunked_dataset_iterator: epochs applies to training streams (train=True); with "
        "train=False the stream is one ordered pass over this rank's contiguous share of the "
        "items, so leave epochs=None, got epochs=1"
    )
    with pytest.raises(ValueError, match=r"^create_source_iterator: epochs applies to training"):
        create_source_iterator(["a"], train=False, shuffle=False, epochs=2)
    with pytest.raises(ValueError, match="InfinitePermutationSourceIterator: epochs must be >= 1"):
        it.InfinitePermutationSourceIterator(["a"], epochs=0)


@pytest.mark.parametrize(("taken", "restored"), [(2, 3), (None, 2), (2, None)])
def test_a_state_of_another_epochs_is_refused_naming_it(
    taken: int | None, restored: int | None
) -> None:
    corpus = corpus_of([2, 3, 2])
    run = pipeline(corpus, buffer_size=3, seed=1, epochs=taken)
    take(run, 4)
    other = pipeline(corpus, buffer_size=3, seed=1, epochs=restored)
    with pytest.raises(StateMismatchError) as raised:
        other.setstate(run.getstate())
    assert str(raised.value) == (
        "checkpoint does not fit this pipeline at BlockwiseShuffleIterator.source > "
        "SelectManyIterator.source > InfinitePermutationSourceIterator: the checkpoint was "
        f"taken with epochs={taken!r}, this stage has epochs={restored!r}; this argument "
        "decides the stream and cannot change at a restart"
    )


def test_a_position_past_the_end_is_refused() -> None:
    source = it.InfinitePermutationSourceIterator(list(range(4)), seed=1, epochs=2,
                                                  num_instances=3, instance_rank=1)
    list(source)
    state = source.getstate()
    assert state["position"] == 10
    state["position"] = 13
    with pytest.raises(StateMismatchError, match=(
        "position 13 is past the end of the stream \\(this rank stops at position 10\\)"
    )):
        source.setstate(state)
