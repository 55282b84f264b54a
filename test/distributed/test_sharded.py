"""ShardedIterator and elastic resume, in one process: the checkpoint contract, exactly once
over a finite pass whatever the old and new numbers of ranks, endless shards that continue
the same whatever the number of ranks, and worker processes restored with another count.
(test/test_distributed.py runs the same under real torchrun jobs.)"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
from collections import defaultdict
from itertools import islice, repeat
from typing import Any, ClassVar

import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like._core.protocol import GATHERED_FORMAT, State
from infinibatch_like._core.regroup import Pooling
from infinibatch_like._core.schema import FieldSpec
from infinibatch_like._core.stage import Stage, fast_iterator, source_state
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import restore_state
from infinibatch_like.distributed.elastic import elastic_state, redistributed_state, why_not_elastic
from infinibatch_like.distributed.sharded import ShardedIterator, owned_shards
from infinibatch_like.stages.sources import create_source_iterator
from infinibatch_like.testing import assert_checkpointable

CORPUS = [[f"c{chunk:02d}-{line}" for line in range(chunk % 5 + 1)] for chunk in range(23)]


def flat(corpus: list[list[str]]) -> list[str]:
    return [item for chunk in corpus for item in chunk]


class finite_factory:
    """A finite shuffled pass per shard (``chunked_dataset_iterator(..., epochs=1)``),
    optionally batched inside the shard."""

    def __init__(self, corpus: list[list[str]], batch: int = 0) -> None:
        self.corpus, self.batch = corpus, batch

    def __call__(self, shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
        chunks = list(range(shard, len(self.corpus), num_shards))
        items: it.CheckpointableIterator[Any] = (
            chunked_dataset_iterator(chunks, self.corpus.__getitem__, 3, seed=shard, epochs=1)
            if chunks  # chunked_dataset_iterator refuses an empty list of chunks
            else it.NativeCheckpointableIterator([])
        )
        return it.FixedBatchIterator(items, self.batch) if self.batch else items


def endless_factory(shard: int, num_shards: int) -> it.CheckpointableIterator[str]:
    chunks = list(range(shard, len(CORPUS), num_shards))
    source = create_source_iterator(chunks, train=True, seed=shard)
    return it.BlockwiseShuffleIterator(it.SelectManyIterator(source, CORPUS.__getitem__), 4, 9)


DIALOG = [[f"d{chunk:02d}-{line}" for line in range(chunk % 3 + 2)] for chunk in range(23)]


def mixed_factory(shard: int, num_shards: int) -> it.CheckpointableIterator[str]:
    """Two endless corpora mixed 3:1 by an exact schedule, inside each shard."""
    chunks = list(range(shard, len(CORPUS), num_shards))
    sources = [
        it.SelectManyIterator(create_source_iterator(chunks, seed=shard), corpus.__getitem__)
        for corpus in (CORPUS, DIALOG)
    ]
    return it.WeightedMultiplexIterator(sources, [3, 1], seed=shard, exact=True)


def chain_factory(shard: int, num_shards: int) -> it.CheckpointableIterator[list[str]]:
    """chunked_dataset_iterator (chunk read-ahead), a thread ParallelMapIterator and bucketed
    batches, inside each shard."""
    chunks = list(range(shard, len(CORPUS), num_shards))
    lines = chunked_dataset_iterator(
        chunks, CORPUS.__getitem__, buffer_size=4, seed=shard, read_ahead_chunks=1
    )
    upper = it.ParallelMapIterator(lines, str.upper, 2, 3, mode="thread")
    return it.BucketedReadaheadBatchIterator(upper, read_ahead=6, key=len, batch_size=2, seed=1)


def shard_of(item: str | list[str], num_shards: int) -> int:
    """The shard of an item (or of a batch, by its first item): its chunk's."""
    first = item[0] if isinstance(item, list) else item
    return int(first[1:3]) % num_shards


def resumed(factory: Any, shards: int, states: list[Any], world_size: int, **options: Any) -> Any:
    """The pipelines of `world_size` ranks restored from the old ranks' `states`."""
    pipelines = []
    for rank in range(world_size):
        pipeline = ShardedIterator(factory, shards, rank, world_size, **options)
        pipeline.setstate(elastic_state(pipeline, states, rank, world_size))
        pipelines.append(pipeline)
    return pipelines


# -- the checkpoint contract -------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        lambda: ShardedIterator(finite_factory(CORPUS), 5, 1, 2),
        lambda: ShardedIterator(finite_factory(CORPUS, batch=2), 4, 0, 1),
        lambda: it.MapIterator(ShardedIterator(endless_factory, 6, 0, 2), str.upper),
    ],
    ids=["finite", "batched", "endless-mapped"],
)
def test_sharded_iterator_is_checkpointable(factory: Any) -> None:
    assert_checkpointable(
        factory, different=lambda: ShardedIterator(finite_factory(CORPUS), 7, 1, 2)
    )


def test_sharded_iterator_with_workers_is_checkpointable() -> None:
    assert_checkpointable(
        lambda: ShardedIterator(finite_factory(CORPUS), 4, 0, 1, workers=2, snapshot_every=3),
        max_items=40,
        restore_points=[0, 1, 7, 20, 40],
        check_damage=False,
    )


# -- exactly once across a change of the number of ranks ----------------------------------


@settings(max_examples=examples(0.6))
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=14),
    shards=st.integers(1, 8),
    old=st.integers(1, 5),
    new=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 30), min_size=5, max_size=5),
    batch=st.sampled_from([0, 2]),
)
def test_every_item_is_delivered_once_across_a_change_of_ranks(
    sizes: list[int], shards: int, old: int, new: int, cuts: list[int], batch: int
) -> None:
    corpus = [[f"c{chunk:02d}-{line}" for line in range(size)] for chunk, size in enumerate(sizes)]
    factory = finite_factory(corpus, batch)
    before: list[Any] = []
    states = []
    for rank in range(old):
        pipeline = ShardedIterator(factory, shards, rank, old)
        before += list(islice(pipeline, cuts[rank]))
        states.append(pipeline.getstate())
        list(islice(pipeline, 3))  # read after the checkpoint: lost in the "crash"
    after = [item for pipeline in resumed(factory, shards, states, new) for item in pipeline]
    delivered = before + after
    if batch:
        delivered = [item for batch_ in delivered for item in batch_]
    assert sorted(delivered) == sorted(flat(corpus))


@pytest.mark.parametrize("factory", [endless_factory, mixed_factory, chain_factory])
def test_endless_shards_continue_the_same_whatever_the_number_of_ranks(factory: Any) -> None:
    shards, per_shard = 6, 12
    threads_before = set(threading.enumerate())
    reference: dict[int, list[Any]] = defaultdict(list)
    with ShardedIterator(factory, shards, 0, 1) as whole:
        for item in islice(whole, 200):
            reference[shard_of(item, shards)].append(item)
    old = [ShardedIterator(factory, shards, rank, 2) for rank in range(2)]
    for rank, pipeline in enumerate(old):
        list(islice(pipeline, 5 + 4 * rank))  # uneven progress per rank
    states = [pipeline.getstate() for pipeline in old]
    start = {shard: count for pipeline in old for shard, count in pipeline.delivered.items()}
    for pipeline in old:
        pipeline.close()
    for new in (1, 2, 3, 6):
        seen: dict[int, list[Any]] = defaultdict(list)
        for pipeline in resumed(factory, shards, states, new):
            with pipeline:
                for item in islice(pipeline, per_shard * len(pipeline.shards)):
                    seen[shard_of(item, shards)].append(item)
        for shard in range(shards):
            expected = reference[shard][start[shard] : start[shard] + per_shard]
            assert seen[shard] == expected, (new, shard)
    # closed, every shard's workers (chain_factory's worker threads) are gone, without
    # waiting for the garbage collector to break the pipelines' reference cycles
    assert [t.name for t in set(threading.enumerate()) - threads_before] == []


def test_load_per_rank_is_balanced_after_a_change_of_ranks() -> None:
    shards = 12
    old = [ShardedIterator(endless_factory, shards, rank, 3) for rank in range(3)]
    states = [pipeline.getstate() for pipeline in old]
    for new in (2, 4, 5):
        owned = [len(owned_shards(shards, rank, new)) for rank in range(new)]
        assert max(owned) - min(owned) <= 1
        pipelines = resumed(endless_factory, shards, states, new)
        assert [pipeline.shards for pipeline in pipelines] == [
            owned_shards(shards, rank, new) for rank in range(new)
        ]


def test_restore_state_resumes_a_two_rank_checkpoint_on_one_process() -> None:
    factory = finite_factory(CORPUS)
    old = [it.MapIterator(ShardedIterator(factory, 4, rank, 2), str.upper) for rank in range(2)]
    before = [item for pipeline in old for item in islice(pipeline, 6)]
    gathered = {
        "format": GATHERED_FORMAT,
        "world_size": 2,
        "ranks": [pipeline.getstate() for pipeline in old],
    }
    single = it.MapIterator(ShardedIterator(factory, 4, 0, 1), str.upper)
    restore_state(single, gathered)
    assert sorted(before + list(single)) == sorted(item.upper() for item in flat(CORPUS))


@pytest.mark.parametrize(
    ("outer", "stage", "why"),
    [
        (lambda s: it.FixedBatchIterator(s, 2), "FixedBatchIterator", "a batch in progress"),
        (
            lambda s: it.BlockwiseShuffleIterator(s, 3, 1),
            "BlockwiseShuffleIterator",
            "its block holds this rank's items",
        ),
        (lambda s: it.PrefetchIterator(s, 2, mode="thread"), "PrefetchIterator", "its replay"),
    ],
)
def test_restore_state_refuses_stages_that_cannot_be_elastic(
    outer: Any, stage: str, why: str
) -> None:
    factory = finite_factory(CORPUS)
    old = [outer(ShardedIterator(factory, 4, rank, 2)) for rank in range(2)]
    gathered = {
        "format": GATHERED_FORMAT,
        "world_size": 2,
        "ranks": [pipeline.getstate() for pipeline in old],
    }
    with pytest.raises(
        ValueError,
        match=f"states of 2 ranks, but this job has 1, and {stage} cannot be elastic \\({why}",
    ):
        restore_state(outer(ShardedIterator(factory, 4, 0, 1)), gathered)


class Tagged(Stage[tuple[str, Any]]):
    """A stage of a user's, ``(tag, item)`` for each item of its source, whose state is its
    source's: it declares itself elastic around its ``"source"`` field."""

    _state_fields: ClassVar[dict[str, FieldSpec]] = {"source": dict}
    _source_field = "source"
    _not_elastic = None

    def __init__(self, source: it.CheckpointableIterator[Any], tag: str = "t") -> None:
        self._source, self._tag = source, tag
        self._sources = (source,)
        self._restore(None)

    def _state(self) -> State:
        return {"source": source_state(self._source)}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._iterator = zip(repeat(self._tag), fast_iterator(self._source))


class Cached(Tagged):
    """The same, declaring why it cannot be elastic."""

    _not_elastic = "its cache holds this rank's items"


def test_a_stage_that_declares_itself_elastic_is_regrouped_through() -> None:
    factory = finite_factory(CORPUS)
    old = [Tagged(ShardedIterator(factory, 6, rank, 2)) for rank in range(2)]
    taken = [item for pipeline in old for _, item in islice(pipeline, 7)]
    states = [pipeline.getstate() for pipeline in old]
    rest = []
    for rank in range(3):
        pipeline = Tagged(ShardedIterator(factory, 6, rank, 3))
        pipeline.setstate(elastic_state(pipeline, states, rank, 3))
        rest += [item for _, item in pipeline]
    assert sorted(taken + rest) == sorted(flat(CORPUS))  # every item once, on one rank
    gathered = {"format": GATHERED_FORMAT, "world_size": 2, "ranks": states}
    single = Tagged(ShardedIterator(factory, 6, 0, 1))
    restore_state(single, gathered)
    assert sorted(taken + [item for _, item in single]) == sorted(flat(CORPUS))


def test_a_stage_that_declares_why_it_is_not_elastic_is_refused_with_its_reason() -> None:
    factory = finite_factory(CORPUS)
    states = [Cached(ShardedIterator(factory, 4, rank, 2)).getstate() for rank in range(2)]
    message = "and Cached cannot be elastic (its cache holds this rank's items)"
    with pytest.raises(ValueError, match=re.escape(message)):
        elastic_state(Cached(ShardedIterator(factory, 4, 0, 1)), states, 0, 1)
    pooling = Pooling("resize", "reader", lambda stage, why: ValueError(f"{stage}: {why}"))
    with pytest.raises(ValueError, match=re.escape("Cached: its cache holds this rank's items")):
        redistributed_state(states, 0, 1, pooling)  # from the states' tags alone
    assert why_not_elastic("Cached") == "its cache holds this rank's items"
    assert why_not_elastic("FixedBatchIterator") == "a batch in progress holds this rank's items"
    default = "it is not a ShardedIterator, or a MapIterator over one"
    assert why_not_elastic("NoSuchStage") == default


def test_elastic_state_refuses_missing_duplicate_shards_and_another_num_shards() -> None:
    old = [ShardedIterator(endless_factory, 4, rank, 2) for rank in range(2)]
    states = [pipeline.getstate() for pipeline in old]
    target = ShardedIterator(endless_factory, 4, 0, 3)
    with pytest.raises(ValueError, match="holds shard 0 twice"):
        elastic_state(target, [states[0], states[0]], 0, 3)
    with pytest.raises(ValueError, match=r"hold shards \[0, 2\], this pipeline has 4 shards"):
        elastic_state(target, states[:1], 0, 3)
    with pytest.raises(ValueError, match=r"hold shards \[0, 1, 2, 3\], this pipeline has 5"):
        elastic_state(ShardedIterator(endless_factory, 5, 0, 3), states, 0, 3)


def test_damaged_shard_entries_are_refused_by_field() -> None:
    pipeline = ShardedIterator(endless_factory, 4, 0, 1)
    state = pipeline.getstate()
    state["shards"][1]["replay"] = "x"
    with pytest.raises(
        StateMismatchError,
        match=r"ShardedIterator: state field 'shards\[1\]\.replay' has type str, expected int: 'x'",
    ):
        pipeline.setstate(state)
    state = pipeline.getstate()
    del state["shards"][0]["ended"]
    with pytest.raises(
        StateMismatchError, match=r"state field 'shards\[0\]' lacks the fields \['ended'\]"
    ):
        pipeline.setstate(state)
    state = pipeline.getstate()
    state["shards"][2]["replay"] = 10**9
    with pytest.raises(
        StateMismatchError,
        match=r"'shards\[2\]\.replay' must be between 0 and snapshot_every=100, got 1000000000",
    ):
        pipeline.setstate(state)
    state = pipeline.getstate()
    state["shards"][3]["delivered"] = -1
    with pytest.raises(StateMismatchError, match=r"'shards\[3\]\.delivered' must be >= 0, got -1"):
        pipeline.setstate(state)


def test_a_rank_state_given_to_another_rank_is_refused() -> None:
    state = ShardedIterator(endless_factory, 4, 0, 2).getstate()
    with pytest.raises(ValueError, match=r"holds shards \[0, 2\], but rank 1 of 2 reads \[1, 3\]"):
        ShardedIterator(endless_factory, 4, 1, 2).setstate(state)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ShardedIterator: num_shards must be >= 1, got 0"):
        ShardedIterator(endless_factory, 0, 0, 1)
    with pytest.raises(TypeError, match="ShardedIterator: factory must be callable"):
        ShardedIterator(None, 2, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank and world_size together"):
        ShardedIterator(endless_factory, 2, 0)
    with pytest.raises(ValueError, match="ShardedIterator: factory\\(0, 2\\)'s result must be"):
        ShardedIterator(lambda shard, n: [shard], 2, 0, 1)  # type: ignore[arg-type,return-value]


# -- worker processes: k -> k' ------------------------------------------------------------


@pytest.mark.parametrize("method", multiprocessing.get_all_start_methods())
def test_a_checkpoint_taken_with_k_workers_restores_with_another_count(method: str) -> None:
    factory = finite_factory(CORPUS, batch=2)
    reference = list(ShardedIterator(factory, 6, 0, 1))
    with ShardedIterator(factory, 6, 0, 1, workers=2, start_method=method) as two:
        assert list(islice(two, 9)) == reference[:9]
        state = two.getstate()
    for workers in (3, 0):
        with ShardedIterator(factory, 6, 0, 1, workers=workers, start_method=method) as other:
            other.setstate(state)
            assert list(other) == reference[9:], workers
    assert not multiprocessing.active_children()


FORK = multiprocessing.get_context("fork")
ASKED = FORK.Event()
"""Set by the test just before its first next()."""
SHARD_1_PULLED = FORK.Event()
"""Set by shard 1's worker when it pulls its first item."""
SEEN = FORK.Array("b", 2)
"""What the workers saw: [shard 1's first item came while shard 0's first one was still
being read, shard 1's first pull came after the first next()]."""


class SlowFirstItem:
    """Shard `shard`'s items 0..4; shard 0's first item (a first block read) lasts until
    shard 1's worker has pulled its first item (at most 20 s)."""

    def __init__(self, shard: int) -> None:
        self.shard = shard

    def __call__(self, item: int) -> int:
        if item == 0 and self.shard == 1:
            SEEN[1] = ASKED.is_set()
            SHARD_1_PULLED.set()
        elif item == 0:
            SEEN[0] = SHARD_1_PULLED.wait(20)
        return 10 * self.shard + item


def slow_first_factory(shard: int, num_shards: int) -> it.CheckpointableIterator[int]:
    return it.MapIterator(it.NativeCheckpointableIterator(range(5)), SlowFirstItem(shard))


def test_every_worker_starts_at_the_first_next_not_after_the_items_before_its_own() -> None:
    ASKED.clear()
    SHARD_1_PULLED.clear()
    SEEN[0] = SEEN[1] = 0
    with ShardedIterator(slow_first_factory, 2, 0, 1, workers=2, start_method="fork") as sharded:
        ASKED.set()
        assert next(sharded) == 0
        # Worker 1 read its first item while worker 0 was in its first one, not once that
        # came, and not before the first next().
        assert list(SEEN) == [1, 1]
        assert list(sharded) == [10, 1, 11, 2, 12, 3, 13, 4, 14]
    assert not multiprocessing.active_children()


# -- set_weights through the ShardedIterator (curricula) -----------------------------------


def per_shard_reference(shards: int, before: dict[int, int], count: int) -> dict[int, list[str]]:
    """Each shard's mixer alone: `before[shard]` items, set_weights([1, 3]), then more."""
    reference = {}
    for shard in range(shards):
        mixer = mixed_factory(shard, shards)
        items = list(islice(mixer, before[shard]))
        mixer.set_weights([1, 3])
        reference[shard] = items + list(islice(mixer, count))
    return reference


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("after", [1, 14])
def test_set_weights_changes_every_shard_from_its_next_item_and_checkpoints_stay_exact(
    workers: int, after: int
) -> None:
    shards, change_at = 6, 17

    def build() -> ShardedIterator[str]:
        return ShardedIterator(mixed_factory, shards, 0, 1, workers=workers, snapshot_every=3)

    with build() as pipeline:
        items = list(islice(pipeline, change_at))
        at_change = pipeline.delivered
        pipeline.set_weights([1, 3])
        items += list(islice(pipeline, after))
        state = json.loads(json.dumps(pipeline.getstate()))  # across the change
        rest = list(islice(pipeline, 24))
    reference = per_shard_reference(shards, at_change, 30)
    seen: dict[int, list[str]] = defaultdict(list)
    for item in items + rest:
        seen[shard_of(item, shards)].append(item)
    for shard in range(shards):
        assert seen[shard] == reference[shard][: len(seen[shard])], shard
    with build() as resumed:
        resumed.setstate(state)
        assert list(islice(resumed, 24)) == rest
    assert not multiprocessing.active_children()


def test_set_weights_needs_one_mixer_per_shard_not_below_a_background_stage() -> None:
    with pytest.raises(ValueError, match="shard 0's pipeline holds 0 WeightedMultiplexIterat"):
        ShardedIterator(endless_factory, 2, 0, 1).set_weights([1, 1])

    def prefetched(shard: int, num_shards: int) -> it.CheckpointableIterator[str]:
        return it.PrefetchIterator(mixed_factory(shard, num_shards), 2, mode="thread")

    with (
        ShardedIterator(prefetched, 2, 0, 1) as pipeline,
        pytest.raises(ValueError, match="shard 0's WeightedMultiplexIterator runs below a Pref"),
    ):
        pipeline.set_weights([1, 1])
    pipeline = ShardedIterator(mixed_factory, 2, 0, 1)
    with pytest.raises(
        ValueError, match=r"set_weights: weights must hold one weight per source \(2\), got 3"
    ):
        pipeline.set_weights([1, 1, 1])
    assert pipeline.getstate()["shards"][0]["source"]["weights"] == [3.0, 1.0]


def test_changed_weights_move_with_their_shards_to_other_ranks() -> None:
    shards = 6
    old = [ShardedIterator(mixed_factory, shards, rank, 2) for rank in range(2)]
    for rank, pipeline in enumerate(old):
        list(islice(pipeline, 4 + 3 * rank))
        pipeline.set_weights([1, 3])
    start = {shard: count for pipeline in old for shard, count in pipeline.delivered.items()}
    states = [pipeline.getstate() for pipeline in old]
    reference = per_shard_reference(shards, start, 12)
    for pipeline in resumed(mixed_factory, shards, states, 3):
        seen: dict[int, list[str]] = defaultdict(list)
        for item in islice(pipeline, 10 * len(pipeline.shards)):
            seen[shard_of(item, shards)].append(item)
        for shard in pipeline.shards:
            assert seen[shard] == reference[shard][start[shard] : start[shard] + 10], shard


def lock_at_4(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    """Shard `shard`'s items ``(shard, 0..7)``; shard 1's item 4 cannot be pickled."""

    def item(index: int) -> Any:
        return threading.Lock() if (shard, index) == (1, 4) else (shard, index)

    return it.MapIterator(it.NativeCheckpointableIterator(list(range(8))), item)


@pytest.mark.parametrize("method", multiprocessing.get_all_start_methods())
def test_an_unpicklable_item_of_a_shard_comes_after_every_item_before_it(method: str) -> None:
    def make() -> ShardedIterator[Any]:
        return ShardedIterator(lock_at_4, 2, 0, 1, workers=2, start_method=method)

    with make() as pipeline:
        got: list[Any] = []
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object") as info:
            got.extend(pipeline)
        # shard 1's worker sends items 0, 1-2, 3-6: item 3 comes before the error
        assert got == [(shard, index) for index in range(4) for shard in (0, 1)] + [(0, 4)]
        assert "in the worker process of PrefetchIterator" in "\n".join(info.value.__notes__)
        state = pipeline.getstate()
    with make() as fresh:  # the state points at the failing item
        fresh.setstate(state)
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
            next(fresh)
    assert not multiprocessing.active_children()
