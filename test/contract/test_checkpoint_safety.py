"""Checkpoints as real training code uses them: keys the caller adds to a state, restoring
an inner stage, getstate after close, states that are snapshots (not views of live fields),
a changed pipeline refused, and huge or damaged counts refused or restored at once."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from _streams import ChunkReader, take
from _waiting import HANG, within

import infinibatch_like.iterators as it
from infinibatch_like._core import rng as _rng
from infinibatch_like._core.protocol import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.testing import assert_checkpointable

CHUNKS = [[f"c{c}-{i}" for i in range(c % 4 + 2)] for c in range(12)]


read_chunk = ChunkReader(CHUNKS)


def dataset(seed: int = 2, chunks: list[int] | None = None) -> it.CheckpointableIterator[Any]:
    refs = list(range(len(CHUNKS))) if chunks is None else chunks
    return chunked_dataset_iterator(refs, read_chunk, buffer_size=5, seed=seed)


# -- keys added by the caller --------------------------------------------------------------


class EpochLoader:
    """A fairseq-style loader: adds its own keys to the pipeline's state and passes the
    whole dict back on resume."""

    def __init__(self) -> None:
        self.pipeline = dataset()
        self.epoch, self.iterations_in_epoch = 1, 0

    def next_batch(self) -> Any:
        self.iterations_in_epoch += 1
        return next(self.pipeline)

    def state_dict(self) -> dict[str, Any]:
        state = self.pipeline.getstate()
        state["epoch"] = self.epoch
        state["iterations_in_epoch"] = self.iterations_in_epoch
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.iterations_in_epoch = state["epoch"], state["iterations_in_epoch"]
        self.pipeline.setstate(state)


def test_a_loader_that_adds_its_own_keys_resumes_exactly() -> None:
    loader = EpochLoader()
    for _ in range(17):
        loader.next_batch()
    saved = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(30)]

    resumed = EpochLoader()
    resumed.load_state_dict(saved)
    assert resumed.iterations_in_epoch == 17
    assert [resumed.next_batch() for _ in range(30)] == expected
    del saved["epoch"], saved["iterations_in_epoch"]
    resumed.load_state_dict({**saved, "epoch": 1, "iterations_in_epoch": 17})
    assert resumed.pipeline.getstate() == saved  # C4, less the caller's keys


def add_keys_everywhere(state: Any) -> Any:
    if isinstance(state, dict):
        extra = {"note": "added by the caller"} if "stage" in state else {}
        return {**{key: add_keys_everywhere(value) for key, value in state.items()}, **extra}
    if isinstance(state, list):
        return [add_keys_everywhere(value) for value in state]
    return state


@pytest.mark.parametrize(
    "build",
    [
        dataset,
        lambda: it.WindowedIterator(it.MapIterator(dataset(), str.upper), 3),
        lambda: it.WeightedMultiplexIterator([dataset(1), dataset(3)], [1, 2], 4),
    ],
)
def test_keys_added_at_every_level_are_ignored(build: Callable[[], Any]) -> None:
    pipeline = build()
    take(pipeline, 23)
    state = pipeline.getstate()
    expected = take(pipeline, 20)
    fresh = build()
    fresh.setstate(add_keys_everywhere(state))
    assert fresh.getstate() == state
    assert take(fresh, 20) == expected


def test_a_wrong_tag_a_missing_key_or_a_wrong_type_is_still_refused() -> None:
    pipeline = dataset()
    state = pipeline.getstate()
    source = state["source"]
    broken: list[dict[str, Any]] = [
        {**state, "stage": "MapIterator"},
        {key: value for key, value in state.items() if key != "emitted"},
        {**state, "emitted": "3"},
        {**state, "source": {**source, "consumed": 2.0}},
    ]
    for checkpoint in broken:
        with pytest.raises(StateMismatchError, match="BlockwiseShuffleIterator"):
            dataset().setstate(checkpoint)


# -- restoring an inner stage --------------------------------------------------------------


def test_restoring_an_inner_stage_directly_stops_the_outer_ones_clearly() -> None:
    inner = it.NativeCheckpointableIterator(list(range(40)))
    middle = it.BlockwiseShuffleIterator(inner, 4, 1)
    outer = it.MapIterator(middle, str)
    take(outer, 6)
    state = outer.getstate()
    early = inner.getstate()
    take(outer, 5)
    inner.setstate(early)
    for call in (lambda: next(outer), outer.getstate, lambda: next(middle)):
        with pytest.raises(RuntimeError) as raised:
            call()
        assert "NativeCheckpointableIterator" in str(raised.value)
        assert "outermost" in str(raised.value)
    outer.setstate(state)  # restoring the outermost stage puts everything back in place
    fresh = it.MapIterator(
        it.BlockwiseShuffleIterator(it.NativeCheckpointableIterator(list(range(40))), 4, 1), str
    )
    fresh.setstate(state)
    assert take(outer, 20) == take(fresh, 20)
    assert outer.getstate() == fresh.getstate()


def test_restores_through_the_outermost_stage_and_before_wrapping_are_fine() -> None:
    inner = it.NativeCheckpointableIterator(list(range(30)))
    inner.setstate({"stage": "NativeCheckpointableIterator", **inner.getstate(), "consumed": 4})
    outer = it.MapIterator(inner, str)  # MapIterator does not reset its source
    assert take(outer, 2) == ["4", "5"]
    outer.setstate(None)
    assert take(outer, 2) == ["0", "1"]


# -- getstate after close ------------------------------------------------------------------


def test_getstate_after_a_with_block_tells_the_true_position() -> None:
    with it.NativeCheckpointableIterator(list(range(10))) as source:
        assert take(source, 3) == [0, 1, 2]
    state = source.getstate()
    fresh = it.NativeCheckpointableIterator(list(range(10)))
    fresh.setstate(state)
    assert take(fresh, 10) == list(range(3, 10))


def test_getstate_after_closing_a_chain_restores_the_continuation() -> None:
    reference = take(dataset(), 40)
    with dataset() as pipeline:
        take(pipeline, 13)
    state = pipeline.getstate()
    fresh = dataset()
    fresh.setstate(state)
    assert take(fresh, 27) == reference[13:]


# -- states are snapshots ------------------------------------------------------------------


def clear_in_place(value: Any) -> None:
    if isinstance(value, dict):
        for item in value.values():
            clear_in_place(item)
        value.clear()
    elif isinstance(value, list):
        for item in value:
            clear_in_place(item)
        value.clear()


@pytest.mark.parametrize(
    "build",
    [
        lambda: it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(12))), read_chunk),
        dataset,
        lambda: it.WindowedIterator(it.NativeCheckpointableIterator(list(range(300))), 3),
    ],
)
def test_changing_a_state_dict_in_or_out_never_changes_the_pipeline(
    build: Callable[[], Any],
) -> None:
    pipeline = build()
    take(pipeline, 7)
    returned = pipeline.getstate()
    kept = json.loads(json.dumps(returned))
    clear_in_place(returned)
    assert pipeline.getstate() == kept

    given = json.loads(json.dumps(kept))
    fresh = build()
    fresh.setstate(given)
    clear_in_place(given)
    assert fresh.getstate() == kept
    assert take(fresh, 30) == take(pipeline, 30)


# -- a changed pipeline --------------------------------------------------------------------


def test_a_state_of_a_reordered_chunk_list_is_refused_naming_the_argument() -> None:
    pipeline = dataset()
    take(pipeline, 9)
    state = pipeline.getstate()
    reordered = list(range(len(CHUNKS)))[::-1]
    with pytest.raises(StateMismatchError) as raised:
        dataset(chunks=reordered).setstate(state)
    assert "InfinitePermutationSourceIterator" in str(raised.value)
    assert "source_items" in str(raised.value)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda n: it.NativeCheckpointableIterator(list(range(n, 30))), "iterable"),
        (lambda n: it.ChunkedSourceIterator(list(range(30)), num_instances=n), "iterable"),
        (lambda n: it.BlockwiseShuffleIterator(it.RandomIterator(1), n + 2), "block_size"),
        (lambda n: it.FixedBatchIterator(it.RandomIterator(1), n + 2), "batch_size"),
        (lambda n: it.WindowedIterator(it.RandomIterator(1), n + 2), "width"),
        (lambda n: it.BufferedShuffleIterator(it.RandomIterator(1), n + 2), "buffer_size"),
        (
            lambda n: it.BucketedReadaheadBatchIterator(it.RandomIterator(1), 10, None, n + 2),
            "batch_size",
        ),
        (
            lambda n: it.InfinitePermutationSourceIterator(list(range(9)), num_instances=2 * n + 1),
            "num_instances",
        ),
        (
            lambda n: it.WeightedMultiplexIterator(
                [it.RandomIterator(1), it.RandomIterator(2)], [1, 1], exact=n == 1
            ),
            "exact",
        ),
    ],
)
def test_a_state_of_other_stream_deciding_arguments_is_refused(
    build: Callable[[int], Any], argument: str
) -> None:
    pipeline = build(1)
    take(pipeline, 3)
    with pytest.raises(StateMismatchError, match=f"{argument}="):
        build(2).setstate(pipeline.getstate())


def test_arguments_that_do_not_change_the_stream_may_change_at_a_restart() -> None:
    def build(read_ahead: int) -> it.CheckpointableIterator[Any]:
        return chunked_dataset_iterator(
            list(range(12)), read_chunk, buffer_size=4, seed=1, read_ahead_chunks=read_ahead
        )

    pipeline = build(0)
    take(pipeline, 11)
    fresh = build(3)
    fresh.setstate(pipeline.getstate())
    assert take(fresh, 25) == take(pipeline, 25)
    fresh.close()


def mixed(weights: list[float]) -> it.WeightedMultiplexIterator[Any]:
    sources = [it.MapIterator(it.RandomIterator(seed), lambda _, s=seed: s) for seed in (0, 1)]
    return it.WeightedMultiplexIterator(sources, weights, 7)


def test_new_constructor_weights_take_effect_at_the_restore_point(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline = mixed([1, 1])
    take(pipeline, 50)
    state = pipeline.getstate()
    resumed = mixed([0, 1])
    with caplog.at_level(logging.INFO, logger="infinibatch_like"):
        resumed.setstate(state)
    assert "from the restore point on" in caplog.text
    assert resumed.weights == [0.0, 1.0]
    assert set(take(resumed, 100)) == {1}
    again = mixed([0, 1])  # the new run's own checkpoints keep the new weights
    again.setstate(resumed.getstate())
    assert again.weights == [0.0, 1.0]


def test_weights_set_during_the_run_continue_when_the_constructor_is_unchanged() -> None:
    pipeline = mixed([1, 1])
    take(pipeline, 10)
    pipeline.set_weights([1, 0])
    take(pipeline, 10)
    resumed = mixed([1, 1])
    resumed.setstate(pipeline.getstate())
    assert resumed.weights == [1.0, 0.0]
    assert take(resumed, 40) == take(pipeline, 40) == [0] * 40


# -- huge or damaged counts ----------------------------------------------------------------


def seeded_pipelines() -> list[Callable[[], it.CheckpointableIterator[Any]]]:
    native = lambda: it.NativeCheckpointableIterator(list(range(50)))  # noqa: E731
    return [
        lambda: it.InfinitePermutationSourceIterator(list(range(7)), seed=3),
        lambda: it.RandomIterator(4),
        lambda: it.SamplingRandomMapIterator(native(), lambda rng, x: x + rng.random(), 1),
        lambda: it.BlockwiseShuffleIterator(native(), 6, 2),
        lambda: it.BufferedShuffleIterator(native(), 6, 2),
        lambda: it.BucketedReadaheadBatchIterator(native(), 9, None, 2, seed=2),
        lambda: it.WeightedMultiplexIterator([native(), native()], [1, 3], 5),
        lambda: it.WindowedIterator(native(), 3),
        lambda: it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(12))), read_chunk),
        lambda: it.NativeCheckpointableIterator(range(10**9)),
    ]


COUNT_FIELDS = ("draws", "count", "emitted", "replay", "consumed", "position")


@pytest.mark.parametrize("build", seeded_pipelines())
@pytest.mark.parametrize("value", [10**18, 2**64, -1])
def test_a_huge_or_negative_count_is_refused_or_restored_quickly(
    build: Callable[[], it.CheckpointableIterator[Any]], value: int
) -> None:
    pipeline = build()
    take(pipeline, 5)
    state = pipeline.getstate()
    fields = [field for field in COUNT_FIELDS if field in state]
    assert fields
    for field in fields:
        fresh = build()
        damaged = {**state, field: value}

        def restore_and_read(fresh: Any = fresh, damaged: Any = damaged) -> None:
            fresh.setstate(damaged)
            take(fresh, 3)

        if field == "position" and value > 0:  # a far position of an endless stream is real
            within(HANG, restore_and_read)
        else:
            with pytest.raises(StateMismatchError, match=type(fresh).__name__):
                within(HANG, restore_and_read)


def test_a_long_run_stores_its_generator_and_restores_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond the redraw limit a state holds the packed generator (here with a small limit)."""
    monkeypatch.setattr(_rng, "REDRAW_LIMIT", 8)
    for build in seeded_pipelines()[:7]:
        pipeline = build()
        take(pipeline, 30)
        state = pipeline.getstate()
        assert isinstance(state.get("generator"), str)
        assert len(json.dumps(state)) < 5_000
        assert_checkpointable(build, max_items=40, check_pickle=False, check_torch=False)


def test_a_count_beyond_the_limit_without_a_generator_is_refused_at_once() -> None:
    state = it.RandomIterator(4).getstate()
    for damaged in (
        {**state, "count": _rng.REDRAW_LIMIT},
        {**state, "count": 3, "generator": "not base64"},
        {**state, "count": 3, "generator": "A" * 3336},
    ):
        with pytest.raises(StateMismatchError, match="RandomIterator"):
            within(HANG, lambda damaged=damaged: it.RandomIterator(4).setstate(damaged))


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: {**s, "counts": ["1", 0]},
        lambda s: {**s, "counts": [1.5, 0]},
        lambda s: {**s, "counts": [0]},
        lambda s: {**s, "active": [1, None]},
        lambda s: {**s, "weights": [True, "x"]},
        lambda s: {**s, "draws": True},
        lambda s: {**s, "draws": None},
        lambda s: {**s, "sources": s["sources"][:1]},
        lambda s: {**s, "sources": [None, s["sources"][1]]},
        lambda s: {**s, "generator": 5},
    ],
)
def test_wrong_types_inside_a_state_are_refused_naming_the_stage(
    damage: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    pipeline = mixed([1, 2])
    take(pipeline, 5)
    with pytest.raises(StateMismatchError, match="WeightedMultiplexIterator"):
        mixed([1, 2]).setstate(damage(pipeline.getstate()))


def test_buffered_shuffle_refuses_bad_empty_slot_indices() -> None:
    pipeline = it.BufferedShuffleIterator(it.NativeCheckpointableIterator(list(range(3))), 8, 1)
    state = pipeline.getstate()
    for empty in ([True], [8], ["0"], [None]):
        with pytest.raises(StateMismatchError, match="BufferedShuffleIterator"):
            it.BufferedShuffleIterator(
                it.NativeCheckpointableIterator(list(range(3))), 8, 1
            ).setstate({**state, "empty": empty})
