"""Bad arguments, foreign states, failures and closed iterators give clear errors."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import pytest
from _items import failing
from _streams import native

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: it.FixedBatchIterator(native(10), 0), ValueError,
         "FixedBatchIterator: batch_size must be >= 1, got 0"),
        (lambda: it.FixedBatchIterator(native(10), 2.0), TypeError,
         "FixedBatchIterator: batch_size must be an int, got 2.0"),
        (lambda: it.BlockwiseShuffleIterator(native(10), -1), ValueError,
         "BlockwiseShuffleIterator: block_size must be >= 1, got -1"),
        (lambda: it.BufferedShuffleIterator(native(10), 0), ValueError,
         "BufferedShuffleIterator: buffer_size must be >= 1, got 0"),
        (lambda: it.BucketedReadaheadBatchIterator(native(10), 0, None, 2), ValueError,
         "BucketedReadaheadBatchIterator: read_ahead must be >= 1, got 0"),
        (lambda: it.BucketedReadaheadBatchIterator(native(10), 5, None, 0), ValueError,
         "BucketedReadaheadBatchIterator: batch_size must be >= 1, got 0"),
        (lambda: it.BucketedReadaheadBatchIterator(native(10), 5, None, "8"), TypeError,
         "BucketedReadaheadBatchIterator: batch_size must be callable, got '8'"),
        (lambda: it.BucketedReadaheadBatchIterator(native(10), 5, 3, 2), TypeError,
         "BucketedReadaheadBatchIterator: key must be callable, got 3"),
        (lambda: it.WindowedIterator(native(10), 0), ValueError,
         "WindowedIterator: width must be >= 1, got 0"),
        (lambda: it.MapIterator(native(10), None), TypeError,
         "MapIterator: transform must be callable, got None"),
        (lambda: it.MapIterator([1, 2], str), ValueError,
         "MapIterator: source_iterator must be a CheckpointableIterator, got list"),
        (lambda: it.ZipIterator(native(10), iter([1])), ValueError,
         "ZipIterator: source_iterators[1] must be a CheckpointableIterator, got list_iterator"),
        (lambda: it.ZipIterator(), ValueError, "ZipIterator: needs at least one source"),
        (lambda: it.MultiplexIterator(native(10), [native(10), 3]), ValueError,
         "MultiplexIterator: source_iterators[1] must be a CheckpointableIterator, got int"),
        (lambda: it.NativeCheckpointableIterator(iter([1, 2])), ValueError,
         "NativeCheckpointableIterator: iterable must be re-iterable, got an iterator"),
        (lambda: it.InfinitePermutationSourceIterator([]), ValueError,
         "InfinitePermutationSourceIterator: source_items must not be empty"),
        (lambda: it.InfinitePermutationSourceIterator([1], num_instances=2, instance_rank=2),
         ValueError, "InfinitePermutationSourceIterator: instance_rank must be < num_instances"),
        (lambda: it.InfinitePermutationSourceIterator([1], seed=1.5), TypeError,
         "InfinitePermutationSourceIterator: seed must be an int, a str or None, got 1.5"),
        (lambda: it.ChunkedSourceIterator([1, 2], num_instances=0), ValueError,
         "ChunkedSourceIterator: num_instances must be >= 1, got 0"),
        (lambda: it.ChunkedSourceIterator([1, 2], num_instances=2, instance_rank=5), ValueError,
         "ChunkedSourceIterator: instance_rank must be < num_instances (2), got 5"),
        (lambda: it.create_source_iterator([1], train=False, shuffle=True), ValueError,
         "create_source_iterator: shuffle=True is not supported when train=False"),
        (lambda: chunked_dataset_iterator([1], list, 4, train=False), ValueError,
         "chunked_dataset_iterator: shuffle=True is not supported when train=False"),
    ],
)
def test_bad_arguments_are_named(build: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        build()


def test_multiplex_names_the_exhausted_source() -> None:
    control = it.NativeCheckpointableIterator([0, 1, 1, 1])
    multiplex = it.MultiplexIterator(control, [native(3), native(2)])
    assert [next(multiplex) for _ in range(3)] == [0, 0, 1]
    with pytest.raises(it.MultiplexSourceExhaustedError,
                       match=re.escape("source_iterators[1] is exhausted")):
        next(multiplex)
    assert issubclass(it.MultiplexSourceExhaustedError, RuntimeError)


def test_multiplex_rejects_a_bad_index() -> None:
    multiplex = it.MultiplexIterator(it.NativeCheckpointableIterator([0, 7]), [native(3)])
    next(multiplex)
    with pytest.raises(ValueError, match=re.escape("yielded 7 at position 1; expected an int")):
        next(multiplex)


def test_foreign_state_names_the_path_to_the_stage() -> None:
    pipeline = it.MapIterator(it.SelectManyIterator(native(10)), str)
    other = it.MapIterator(native(10), str)
    with pytest.raises(StateMismatchError) as caught:
        pipeline.setstate(other.getstate())
    assert str(caught.value) == (
        "checkpoint does not fit this pipeline at MapIterator.source > SelectManyIterator: "
        "expected a state of SelectManyIterator, got one of 'NativeCheckpointableIterator'"
    )


def test_gathered_state_given_to_setstate_points_to_restore_state() -> None:
    from infinibatch_like.distributed import gather_state

    pipeline = it.MapIterator(native(10), str)
    next(pipeline)
    gathered = gather_state(pipeline)
    with pytest.raises(StateMismatchError) as caught:
        it.MapIterator(native(10), str).setstate(gathered)
    assert str(caught.value) == (
        "checkpoint does not fit this pipeline at MapIterator: this is every rank's state "
        "gathered by gather_state(); restore it with "
        "infinibatch_like.distributed.restore_state(pipeline, state), which gives each rank "
        "its own"
    )


@pytest.mark.parametrize(("use_windowed", "stage", "own"), [
    (False, "BlockwiseShuffleIterator", "block_size"),
    (True, "BufferedShuffleIterator", "buffer_size"),
])
def test_changed_buffer_size_is_named_as_passed_to_chunked_dataset_iterator(
    use_windowed: bool, stage: str, own: str
) -> None:
    def build(buffer_size: int) -> it.CheckpointableIterator[int]:
        return chunked_dataset_iterator(
            [[1, 2, 3], [4, 5]], list, buffer_size=buffer_size, seed=1,
            use_windowed=use_windowed,
        )

    before = build(4)
    next(before)
    pickled = pickle.loads(pickle.dumps(build(5)))  # the labels survive pickling
    for pipeline in (build(5), pickled):
        with pytest.raises(StateMismatchError) as caught:
            pipeline.setstate(before.getstate())
        assert str(caught.value) == (
            f"checkpoint does not fit this pipeline at {stage}: the checkpoint was taken with "
            f"chunked_dataset_iterator's buffer_size=4, this pipeline has 5 ({stage}'s {own}); "
            "this argument decides the stream and cannot change at a restart"
        )
    unlabelled = getattr(it, stage)(it.NativeCheckpointableIterator([1, 2]), 4, seed=0)
    other = getattr(it, stage)(it.NativeCheckpointableIterator([1, 2]), 5, seed=0)
    with pytest.raises(StateMismatchError, match=rf"taken with {own}=4, this stage has {own}=5"):
        other.setstate(unlabelled.getstate())


def test_changed_chunk_refs_are_named_as_passed_to_chunked_dataset_iterator() -> None:
    training = chunked_dataset_iterator([[1, 2, 3], [4, 5]], list, buffer_size=4, seed=1)
    other_refs = chunked_dataset_iterator([[1, 2, 3], [4, 6]], list, buffer_size=4, seed=1)
    with pytest.raises(StateMismatchError, match=(
        r"InfinitePermutationSourceIterator: the checkpoint was taken with "
        r"chunked_dataset_iterator's chunk_refs='2 items #\w+', this pipeline has '2 items "
        r"#\w+' \(InfinitePermutationSourceIterator's source_items\)"
    )):
        other_refs.setstate(training.getstate())
    share = chunked_dataset_iterator([[1], [2], [3]], list, 1, train=False, shuffle=False)
    other_share = chunked_dataset_iterator([[1], [2]], list, 1, train=False, shuffle=False)
    with pytest.raises(StateMismatchError, match=(
        r"taken with chunked_dataset_iterator's chunk_refs \(this rank's share\)='3 items"
    )):
        other_share.setstate(share.getstate())


def test_state_with_wrong_field_type_is_refused() -> None:
    with pytest.raises(StateMismatchError, match="field 'consumed' has type bool, expected int"):
        native(10).setstate({"stage": "NativeCheckpointableIterator", "consumed": True})


@pytest.mark.parametrize(
    ("build", "field", "value", "message"),
    [
        (lambda: native(10), "consumed", -1, "NativeCheckpointableIterator: state field "
         "'consumed' must be >= 0, got -1"),
        (lambda: it.SelectManyIterator(native(10)), "consumed", -2, "SelectManyIterator: state "
         "field 'consumed' must be >= 0, got -2"),
        (lambda: it.WindowedIterator(native(10), 2), "replay", 128, "WindowedIterator: state field "
         "'replay' must be >= 0 and < 128, got 128"),
        (lambda: it.BufferedShuffleIterator(native(10), 4), "draws", -1, "BufferedShuffleIterator: "
         "state field 'draws' must be >= 0, got -1"),
        (lambda: it.RandomIterator(seed=1), "count", -1, "RandomIterator: state field 'count' "
         "must be >= 0, got -1"),
        (lambda: it.BucketedReadaheadBatchIterator(native(10), 4, None, 2), "emitted", 5,
         "BucketedReadaheadBatchIterator: state field 'emitted' must be between 0 and 4, got 5"),
        (lambda: it.PrefetchIterator(native(10), 2, mode="thread", snapshot_every=3), "replay", 4,
         "PrefetchIterator: state field 'replay' must be between 0 and snapshot_every=3, got 4; "
         "if the state came from a stage built with a larger snapshot_every, build this one "
         "with it too"),
    ],
)
def test_a_count_out_of_range_in_a_state_is_refused_naming_stage_and_field(
    build: Any, field: str, value: int, message: str
) -> None:
    pipeline = build()
    state = pipeline.getstate()
    assert field in state
    with pytest.raises(StateMismatchError, match=re.escape(message)):
        build().setstate({**state, field: value})


def test_state_beyond_the_data_is_refused() -> None:
    with pytest.raises(StateMismatchError, match="skips 11 items, but the iterable has 10"):
        native(10).setstate({"stage": "NativeCheckpointableIterator", "consumed": 11})


def test_state_taken_with_another_seed_is_refused() -> None:
    state = it.BlockwiseShuffleIterator(native(10), 3, seed=2).getstate()
    with pytest.raises(StateMismatchError, match="taken with seed 2, this stage has 1"):
        it.BlockwiseShuffleIterator(native(10), 3, seed=1).setstate(state)


def test_drawn_seed_is_kept_and_adopted() -> None:
    first = it.BlockwiseShuffleIterator(native(40), 40, seed=None)
    stream = list(first)
    first.setstate(None)
    assert list(first) == stream
    first.setstate(None)
    next(first)
    state = first.getstate()
    other = it.BlockwiseShuffleIterator(native(40), 40, seed=None)
    other.setstate(state)
    assert list(other) == stream[1:]


def test_error_in_a_stage_is_not_turned_into_the_end_of_the_stream() -> None:
    pipeline = it.FixedBatchIterator(it.MapIterator(native(10), failing), 2)
    assert next(pipeline) == [0, 1]
    state = pipeline.getstate()
    with pytest.raises(KeyError, match="bad record"):
        next(pipeline)
    with pytest.raises(RuntimeError, match="FixedBatchIterator stopped after an error") as caught:
        next(pipeline)
    assert isinstance(caught.value.__cause__, KeyError)
    pipeline.setstate(state)
    with pytest.raises(KeyError):
        next(pipeline)


def test_closed_iterator_refuses_next_and_setstate() -> None:
    pipeline = it.MapIterator(native(10), str)
    pipeline.close()
    pipeline.close()
    with pytest.raises(RuntimeError, match="MapIterator is closed"):
        next(pipeline)
    with pytest.raises(RuntimeError, match=r"MapIterator.setstate: the iterator is closed"):
        pipeline.setstate(None)


def test_context_manager_closes_the_whole_chain() -> None:
    source = native(10)
    with it.MapIterator(source, str) as pipeline:
        assert next(pipeline) == "0"
    with pytest.raises(RuntimeError, match="NativeCheckpointableIterator is closed"):
        next(source)


def test_unpicklable_callable_is_refused_clearly() -> None:
    pipeline = it.FixedBatchIterator(it.MapIterator(native(10), lambda x: x), 2)
    with pytest.raises(pickle.PicklingError,
                       match="cannot pickle MapIterator: its transform <function"):
        pickle.dumps(pipeline)


def test_state_mismatch_error_survives_pickling() -> None:
    error = StateMismatchError("reason", ("A.source", "B"))
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)


def test_advancing_past_the_end_names_how_far_it_got() -> None:
    iterator = iter(range(5))
    assert it._advance_iterator(iterator, 3) == 3
    assert next(iterator) == 3
    with pytest.raises(RuntimeError, match="ended after 1 of 2 items"):
        it._advance_iterator(iterator, 2)


def test_buffered_shuffle_keeps_none_items() -> None:
    items = [None, 1, None, None, 2, None]
    shuffled = list(it.BufferedShuffleIterator(it.NativeCheckpointableIterator(items), 3, 4))
    assert sorted(shuffled, key=repr) == sorted(items, key=repr)


def test_boundary_key_returning_none_is_named() -> None:
    batches = it.BucketedReadaheadBatchIterator(native(10), 4, None, 2, boundary_key=lambda x: None)
    with pytest.raises(ValueError, match="boundary_key returned None for 0"):
        next(batches)


def _chunk_with_pid(chunk: int) -> list[tuple[int, int]]:
    return [(chunk, os.getpid())]


def test_prefetch_true_really_prefetches() -> None:
    from infinibatch_like.stages.prefetch import PrefetchIterator

    with chunked_dataset_iterator(list(range(6)), _chunk_with_pid, 4, prefetch=True, seed=1,
                                  train=False, shuffle=False) as pipeline:
        assert isinstance(pipeline, PrefetchIterator)
        items = list(pipeline)
    assert [chunk for chunk, _ in items] == list(range(6))
    assert os.getpid() not in {pid for _, pid in items}  # read in the worker process
