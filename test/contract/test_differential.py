"""Differential tests: infinibatch_like must yield exactly what infinibatch 0.1.1 yields.

Every pipeline below is described once, as a factory that builds it from a library (the
oracle ``infinibatch`` or ours). For each generated example the factory is run on both
libraries and the item streams are compared. The same example also checks restore: our
pipeline is advanced by ``k`` items, checkpointed (sometimes through a JSON round trip),
the checkpoint is loaded into a *fresh* pipeline of ours, and what follows must equal the
oracle's uninterrupted stream from position ``k``. The oracle's own restore is never used.
"""

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import infinibatch.datasets as ibd
import infinibatch.iterators as ib
import pytest
from _profiles import examples
from _streams import take
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.datasets as ild
import infinibatch_like.iterators as il


@dataclass(frozen=True)
class Lib:
    """One implementation of the infinibatch API: its iterators and datasets modules."""

    name: str
    it: ModuleType
    ds: ModuleType


ORACLE = Lib("infinibatch", ib, ibd)
OURS = Lib("infinibatch_like", il, ild)

Factory = Callable[[Lib], Iterator[Any]]

# Guard for streams that should be finite: far more than any generated example yields.
FINITE = 10_000

DIFF = settings(max_examples=examples(2))

seeds = st.integers(min_value=0, max_value=2**40)
small_ints = st.integers(min_value=0, max_value=999)
item_lists = st.lists(small_ints, max_size=60)
words = st.text(alphabet="abcd", min_size=1, max_size=7)


def assert_same_items(expected: list[Any], got: list[Any], what: str, offset: int = 0) -> None:
    """Fail with the first differing position (counted in the uninterrupted stream)."""
    if got == expected:
        return
    pairs = zip(expected, got, strict=False)
    pos = next((i for i, (e, g) in enumerate(pairs) if e != g), min(len(expected), len(got)))

    def at(items: list[Any]) -> str:
        return repr(items[pos]) if pos < len(items) else "<end of stream>"

    pytest.fail(
        f"{what}: first difference at stream position {offset + pos}: "
        f"expected {at(expected)}, got {at(got)} "
        f"(expected {len(expected)} items, got {len(got)})"
    )


def check(make: Factory, data: st.DataObject, limit: int = FINITE) -> None:
    """Compare our first ``limit`` items with the oracle's, then restore a fresh pipeline
    of ours mid-stream (after ``k`` items, ``k`` drawn) and compare what follows."""
    expected = take(make(ORACLE), limit)
    if limit == FINITE:
        assert len(expected) < FINITE, "the oracle stream was expected to be finite"
    ours = make(OURS)
    k = data.draw(st.integers(min_value=0, max_value=len(expected)), label="k")
    head = take(ours, k)
    state = ours.getstate()
    if data.draw(st.booleans(), label="json_round_trip"):
        state = json.loads(json.dumps(state))
    rest = take(ours, limit - k)
    assert_same_items(expected, head + rest, "uninterrupted stream")

    fresh = make(OURS)
    fresh.setstate(state)
    assert_same_items(expected[k:], take(fresh, limit - k), f"after restore at k={k}", k)


def native(lib: Lib, items: list[Any]) -> Any:
    return lib.it.NativeCheckpointableIterator(items)


def draw_rank(data: st.DataObject, max_instances: int) -> tuple[int, int]:
    num_instances = data.draw(st.integers(1, max_instances), label="num_instances")
    instance_rank = data.draw(st.integers(0, num_instances - 1), label="instance_rank")
    return num_instances, instance_rank


# ---------------------------------------------------------------------------------------
# Sources


@DIFF
@given(items=item_lists, data=st.data())
def test_native_checkpointable_iterator(items: list[int], data: st.DataObject) -> None:
    check(lambda lib: native(lib, items), data)


@DIFF
@given(items=item_lists, data=st.data())
def test_chunked_source_iterator(items: list[int], data: st.DataObject) -> None:
    n, rank = draw_rank(data, len(items) + 3)

    def make(lib: Lib) -> Any:
        return lib.it.ChunkedSourceIterator(items, num_instances=n, instance_rank=rank)

    check(make, data)


@DIFF
@given(items=st.lists(small_ints, min_size=1, max_size=60), seed=seeds, shuffle=st.booleans(),
       data=st.data())
def test_infinite_permutation_source_iterator(
    items: list[int], seed: int, shuffle: bool, data: st.DataObject
) -> None:
    n, rank = draw_rank(data, len(items) + 5)  # also num_instances > len(items)

    def make(lib: Lib) -> Any:
        return lib.it.InfinitePermutationSourceIterator(
            items, seed=seed, shuffle=shuffle, num_instances=n, instance_rank=rank
        )

    check(make, data, limit=3 * len(items) + 5)


@DIFF
@given(items=item_lists, train=st.booleans(), seed=seeds, shuffle=st.booleans(), data=st.data())
def test_create_source_iterator(
    items: list[int], train: bool, seed: int, shuffle: bool, data: st.DataObject
) -> None:
    if train and not items:
        items = [7]
    shuffle = shuffle and train  # eval mode requires shuffle=False
    n, rank = draw_rank(data, len(items) + 3)

    def make(lib: Lib) -> Any:
        return lib.it.create_source_iterator(
            items, train=train, seed=seed, shuffle=shuffle, num_instances=n, instance_rank=rank
        )

    check(make, data, limit=3 * len(items) + 5)


# ---------------------------------------------------------------------------------------
# Transforms and structure


def doubled(xs: list[int]) -> Iterator[int]:
    return (2 * x for x in xs)


@DIFF
@given(
    nested=st.lists(st.lists(small_ints, max_size=5), max_size=15),
    selector=st.sampled_from([None, doubled, tuple]),
    data=st.data(),
)
def test_select_many_iterator(
    nested: list[list[int]], selector: Callable[[Any], Any] | None, data: st.DataObject
) -> None:
    def make(lib: Lib) -> Any:
        if selector is None:
            return lib.it.SelectManyIterator(native(lib, nested))
        return lib.it.SelectManyIterator(native(lib, nested), collection_selector=selector)

    check(make, data)


@DIFF
@given(items=item_lists, data=st.data())
def test_map_iterator(items: list[int], data: st.DataObject) -> None:
    check(lambda lib: lib.it.MapIterator(native(lib, items), lambda x: (x, x * x % 17)), data)


@DIFF
@given(sources=st.lists(item_lists, min_size=1, max_size=4), data=st.data())
def test_zip_iterator(sources: list[list[int]], data: st.DataObject) -> None:
    check(lambda lib: lib.it.ZipIterator(*(native(lib, s) for s in sources)), data)


@DIFF
@given(items=item_lists, width=st.integers(1, 6), data=st.data())
def test_windowed_iterator(items: list[int], width: int, data: st.DataObject) -> None:
    check(lambda lib: lib.it.WindowedIterator(native(lib, items), width), data)


@DIFF
@given(items=item_lists, batch_size=st.integers(1, 10), data=st.data())
def test_fixed_batch_iterator(items: list[int], batch_size: int, data: st.DataObject) -> None:
    check(lambda lib: lib.it.FixedBatchIterator(native(lib, items), batch_size), data)


@DIFF
@given(seed=seeds, length=st.integers(0, 60), data=st.data())
def test_random_iterator(seed: int, length: int, data: st.DataObject) -> None:
    check(lambda lib: lib.it.RandomIterator(seed=seed), data, limit=length)


def running_sum(state: int, item: int) -> tuple[int, tuple[int, int]]:
    return state + item, (state, item)


def last_three(state: list[int], item: int) -> tuple[list[int], list[int]]:
    window = [*state, item][-3:]
    return window, window


@DIFF
@given(
    items=item_lists,
    step=st.sampled_from([(running_sum, 5), (running_sum, 0), (last_three, [1, 2])]),
    data=st.data(),
)
def test_recurrent_iterator(items: list[int], step: tuple[Any, Any], data: st.DataObject) -> None:
    step_function, initial_state = step

    def make(lib: Lib) -> Any:
        return lib.it.RecurrentIterator(native(lib, items), step_function, initial_state)

    check(make, data)


def draw_float(rng: random.Random, item: int) -> tuple[int, float]:
    return item, rng.random()


def draw_below(rng: random.Random, item: int) -> int:
    return rng.randrange(item + 1)


def draw_choice(rng: random.Random, item: int) -> str:
    return rng.choice("abcdefg"[: item % 7 + 1])


def draw_permutation(rng: random.Random, item: int) -> list[int]:
    xs = list(range(item % 9))
    rng.shuffle(xs)
    return xs


def draw_everything(rng: random.Random, item: int) -> tuple[Any, ...]:
    return tuple(f(rng, item) for f in (draw_float, draw_below, draw_choice, draw_permutation))


@DIFF
@given(
    items=item_lists,
    transform=st.sampled_from(
        [draw_float, draw_below, draw_choice, draw_permutation, draw_everything]
    ),
    seed=seeds,
    data=st.data(),
)
def test_sampling_random_map_iterator(
    items: list[int], transform: Any, seed: int, data: st.DataObject
) -> None:
    check(lambda lib: lib.it.SamplingRandomMapIterator(native(lib, items), transform, seed), data)


@DIFF
@given(
    num_sources=st.integers(1, 4),
    extra=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    data=st.data(),
)
def test_multiplex_iterator(num_sources: int, extra: list[int], data: st.DataObject) -> None:
    control = data.draw(st.lists(st.integers(0, num_sources - 1), max_size=60), label="control")
    # every source holds at least as many items as the control asks of it
    sources = [
        [1000 * i + j for j in range(control.count(i) + extra[i])] for i in range(num_sources)
    ]

    def make(lib: Lib) -> Any:
        return lib.it.MultiplexIterator(native(lib, control), [native(lib, s) for s in sources])

    check(make, data)


# ---------------------------------------------------------------------------------------
# Shuffling and batching


@DIFF
@given(items=item_lists, buffer_size=st.integers(1, 20), seed=seeds, data=st.data())
def test_buffered_shuffle_iterator(
    items: list[int], buffer_size: int, seed: int, data: st.DataObject
) -> None:
    # items are never None: infinibatch drops None items, we keep them on purpose
    check(lambda lib: lib.it.BufferedShuffleIterator(native(lib, items), buffer_size, seed), data)


@DIFF
@given(items=item_lists, block_size=st.integers(1, 20), seed=seeds, data=st.data())
def test_blockwise_shuffle_iterator(
    items: list[int], block_size: int, seed: int, data: st.DataObject
) -> None:
    check(lambda lib: lib.it.BlockwiseShuffleIterator(native(lib, items), block_size, seed), data)


@pytest.mark.parametrize("lib", [ORACLE, OURS], ids=lambda lib: lib.name)
def test_blockwise_shuffle_documented_example(lib: Lib) -> None:
    shuffled = lib.it.BlockwiseShuffleIterator(native(lib, list(range(10))), 4, 0)
    assert list(shuffled) == [2, 0, 1, 3, 4, 5, 7, 6, 8, 9]


def by_thirds(word: str) -> int:
    return len(word) // 3  # many ties: tests the stability of the sort


def first_letter(word: str) -> str:
    return word[0]


def inverse_length(longest: str) -> int:
    return max(1, 20 // len(longest))


def zero(longest: str) -> int:
    return 0


def length_mod_three(longest: str) -> int:
    return len(longest) % 3  # 0 for some batches


keys = st.sampled_from([None, len, by_thirds, first_letter])
batch_sizes = st.one_of(
    st.integers(1, 8), st.sampled_from([inverse_length, zero, length_mod_three])
)
boundary_keys = st.sampled_from([None, first_letter, by_thirds])


@settings(max_examples=examples(4))
@given(
    items=st.lists(words, max_size=60),
    read_ahead=st.integers(1, 20),
    key=keys,
    batch_size=batch_sizes,
    boundary_key=boundary_keys,
    shuffle=st.booleans(),
    seed=seeds,
    data=st.data(),
)
def test_bucketed_readahead_batch_iterator(
    items: list[str],
    read_ahead: int,
    key: Any,
    batch_size: Any,
    boundary_key: Any,
    shuffle: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    def make(lib: Lib) -> Any:
        return lib.it.BucketedReadaheadBatchIterator(
            native(lib, items), read_ahead, key, batch_size,
            boundary_key=boundary_key, shuffle=shuffle, seed=seed,
        )  # fmt: skip

    check(make, data)


# ---------------------------------------------------------------------------------------
# datasets


def plus_half(item: int) -> float:
    return item + 0.5


def chunk_lists(min_chunk_size: int, min_chunks: int) -> st.SearchStrategy[list[list[int]]]:
    chunk = st.lists(small_ints, min_size=min_chunk_size, max_size=8)
    return st.lists(chunk, min_size=min_chunks, max_size=8)


def chunked_dataset(chunks: list[list[int]], **kwargs: Any) -> Factory:
    def make(lib: Lib) -> Any:
        refs = list(range(len(chunks)))
        return lib.ds.chunked_dataset_iterator(refs, chunks.__getitem__, **kwargs)

    return make


@DIFF
@given(
    # train mode is infinite: with shuffle=False a rank whose chunks were all empty would
    # spin forever in both libraries, so training chunks are never empty
    chunks=chunk_lists(min_chunk_size=1, min_chunks=1),
    buffer_size=st.integers(1, 20),
    seed=seeds,
    shuffle=st.booleans(),
    use_windowed=st.booleans(),
    transform=st.sampled_from([None, plus_half]),
    data=st.data(),
)
def test_chunked_dataset_iterator_train(
    chunks: list[list[int]],
    buffer_size: int,
    seed: int,
    shuffle: bool,
    use_windowed: bool,
    transform: Any,
    data: st.DataObject,
) -> None:
    n, rank = draw_rank(data, len(chunks) + 3)
    make = chunked_dataset(
        chunks, buffer_size=buffer_size, train=True, seed=seed, shuffle=shuffle,
        use_windowed=use_windowed, transform=transform, num_instances=n, instance_rank=rank,
    )  # fmt: skip
    check(make, data, limit=3 * sum(map(len, chunks)) + 5)


@DIFF
@given(
    chunks=chunk_lists(min_chunk_size=0, min_chunks=0),
    buffer_size=st.integers(1, 20),
    use_windowed=st.booleans(),
    transform=st.sampled_from([None, plus_half]),
    data=st.data(),
)
def test_chunked_dataset_iterator_eval(
    chunks: list[list[int]],
    buffer_size: int,
    use_windowed: bool,
    transform: Any,
    data: st.DataObject,
) -> None:
    n, rank = draw_rank(data, len(chunks) + 3)
    make = chunked_dataset(
        chunks, buffer_size=buffer_size, train=False, shuffle=False,
        use_windowed=use_windowed, transform=transform, num_instances=n, instance_rank=rank,
    )  # fmt: skip
    check(make, data)


@DIFF
@given(
    chunks=chunk_lists(min_chunk_size=1, min_chunks=1),
    buffer_size=st.integers(1, 20),
    seed=seeds,
    shuffle=st.booleans(),
    use_windowed=st.booleans(),
    epochs=st.integers(1, 3),
    data=st.data(),
)
def test_chunked_dataset_iterator_epochs_is_infinibatchs_stream_until_its_last_buffer(
    chunks: list[list[int]],
    buffer_size: int,
    seed: int,
    shuffle: bool,
    use_windowed: bool,
    epochs: int,
    data: st.DataObject,
) -> None:
    """epochs=n: the chunks of infinibatch's endless stream up to n passes, and its items
    up to the last shuffle buffer (which is emptied, or shuffled short, at the end)."""
    n, rank = draw_rank(data, len(chunks) + 3)
    rank_args = dict(num_instances=n, instance_rank=rank)
    refs = list(range(len(chunks)))
    chunk_count = len(range(rank, epochs * len(chunks), n))
    oracle_chunks = take(ib.create_source_iterator(refs, seed=seed, shuffle=shuffle, **rank_args),
                         chunk_count)  # fmt: skip
    our_chunks = il.create_source_iterator(refs, seed=seed, shuffle=shuffle, epochs=epochs,
                                           **rank_args)  # fmt: skip
    assert_same_items(oracle_chunks, list(our_chunks), "chunks")

    kwargs = dict(buffer_size=buffer_size, seed=seed, shuffle=shuffle, use_windowed=use_windowed,
                  **rank_args)  # fmt: skip
    ours = list(ild.chunked_dataset_iterator(refs, chunks.__getitem__, epochs=epochs, **kwargs))
    assert sorted(ours) == sorted(item for chunk in oracle_chunks for item in chunks[chunk])
    oracle = take(ibd.chunked_dataset_iterator(refs, chunks.__getitem__, **kwargs), len(ours))
    if not shuffle:
        same = len(ours)
    elif use_windowed:
        same = max(0, len(ours) - buffer_size)
    else:
        same = len(ours) - len(ours) % buffer_size
    assert_same_items(oracle[:same], ours[:same], "items")


@given(seed=st.one_of(st.none(), st.integers(-(2**40), 2**40)), step=st.integers(-3, 5))
def test_bump_seed(seed: int | None, step: int) -> None:
    assert ild.bump_seed(seed) == ibd.bump_seed(seed)
    assert ild.bump_seed(seed, step) == ibd.bump_seed(seed, step)


@settings(max_examples=examples(1.5))
@given(
    chunks=chunk_lists(min_chunk_size=1, min_chunks=1),
    seed=seeds,
    use_windowed=st.booleans(),
    read_ahead=st.integers(1, 20),
    batch_size=st.sampled_from([3, inverse_length, length_mod_three]),
    data=st.data(),
)
def test_training_pipeline(
    chunks: list[list[int]],
    seed: int,
    use_windowed: bool,
    read_ahead: int,
    batch_size: Any,
    data: st.DataObject,
) -> None:
    """The design's training loop: a chunked dataset of words, bucketed into batches."""
    words_of = [[f"w{x}" for x in chunk] for chunk in chunks]
    dataset = chunked_dataset(words_of, buffer_size=7, seed=seed, use_windowed=use_windowed)

    def make(lib: Lib) -> Any:
        return lib.it.BucketedReadaheadBatchIterator(
            dataset(lib), read_ahead, len, batch_size, seed=seed + 1
        )

    check(make, data, limit=sum(map(len, chunks)) + 5)


# ---------------------------------------------------------------------------------------
# Module surface


@given(n=st.integers(0, 30), k=st.integers(0, 40))
def test_advance_iterator(n: int, k: int) -> None:
    iterator = iter(range(n))
    if k > n:
        with pytest.raises(RuntimeError):
            il._advance_iterator(iterator, k)
    else:
        assert il._advance_iterator(iterator, k) == k
        assert next(iterator, None) == (k if k < n else None)


def star_import_names(module_name: str) -> set[str]:
    namespace: dict[str, Any] = {}
    exec(f"from {module_name} import *", namespace)
    return {name for name in namespace if not (name.startswith("__") and name.endswith("__"))}


def test_star_import_provides_every_infinibatch_name() -> None:
    missing = star_import_names("infinibatch.iterators") - star_import_names(
        "infinibatch_like.iterators"
    )
    assert not missing, f"missing from `from infinibatch_like.iterators import *`: {missing}"
