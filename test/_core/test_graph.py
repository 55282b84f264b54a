"""The pipeline graph: one walk, one path format (in walks, errors and chain descriptions),
and stages' reprs."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like._core.graph import Place, chain, stages, walk
from infinibatch_like.distributed import ShardedIterator


def parse(line: str) -> int:
    return int(line)


def native(count: int = 5) -> it.NativeCheckpointableIterator[int]:
    return it.NativeCheckpointableIterator(list(range(count)))


class Plain(it.CheckpointableIterator[int]):
    """An iterator written outside the library: the walk sees it, as a leaf."""

    def __next__(self) -> int:
        return 1

    def getstate(self) -> dict[str, Any]:
        return {}

    def setstate(self, checkpoint: dict[str, Any] | None) -> None:
        pass

    def close(self) -> None:
        pass


def branching() -> it.FixedBatchIterator[Any]:
    zipped = it.ZipIterator(it.MapIterator(native(), str), Plain())
    return it.FixedBatchIterator(zipped, 2)


def test_the_walk_goes_depth_first_with_sources_in_order_and_names_each_place() -> None:
    places = list(walk(branching()))
    assert [place.path for place in places] == [
        "FixedBatchIterator",
        "FixedBatchIterator.source > ZipIterator",
        "FixedBatchIterator.source > ZipIterator.sources[0] > MapIterator",
        "FixedBatchIterator.source > ZipIterator.sources[0] > MapIterator.source > "
        "NativeCheckpointableIterator",
        "FixedBatchIterator.source > ZipIterator.sources[1] > Plain",
    ]
    assert [place.depth for place in places] == [0, 1, 2, 3, 2]
    assert places[3].parent is places[2]
    assert [type(up.stage).__name__ for up in places[3].above()] == [
        "MapIterator",
        "ZipIterator",
        "FixedBatchIterator",
    ]


def test_a_path_is_the_attribute_access_that_reaches_the_stage() -> None:
    pipeline = branching()
    for place in walk(pipeline):
        steps = place.path.split(" > ")
        reached: Any = pipeline
        for step in steps[:-1]:
            attribute = step.partition(".")[2]
            reached = (
                reached.source
                if attribute == "source"
                else reached.sources[int(attribute[len("sources[") : -1])]
            )
        assert reached is place.stage


def test_the_walk_stops_where_asked_and_lists_library_stages_apart() -> None:
    pipeline = branching()

    def above_zip(place: Place) -> bool:
        return not isinstance(place.stage, it.ZipIterator)

    assert [type(place.stage).__name__ for place in walk(pipeline, above_zip)] == [
        "FixedBatchIterator",
        "ZipIterator",
    ]
    assert [type(stage).__name__ for stage in stages(pipeline)] == [
        "FixedBatchIterator",
        "ZipIterator",
        "MapIterator",
        "NativeCheckpointableIterator",
    ]
    assert list(walk(iter([1, 2]))) == []


def test_copies_of_one_pipeline_share_a_pattern() -> None:
    sharded = ShardedIterator(lambda shard, count: it.MapIterator(native(), str), 3, 0, 1)
    places = list(walk(sharded))
    assert [place.pattern for place in places] == [
        "ShardedIterator",
        "ShardedIterator.source > _ShardGroup",
        *[
            "ShardedIterator.source > _ShardGroup.sources[*] > MapIterator",
            "ShardedIterator.source > _ShardGroup.sources[*] > MapIterator.source > "
            "NativeCheckpointableIterator",
        ]
        * 3,
    ]
    assert places[4].path == "ShardedIterator.source > _ShardGroup.sources[1] > MapIterator"


def test_a_chain_is_written_as_a_path_down_to_where_it_branches() -> None:
    mapped = it.MapIterator(native(), str)
    assert chain(mapped) == "MapIterator.source > NativeCheckpointableIterator"
    assert chain(branching()) == "FixedBatchIterator.source > ZipIterator"
    deep: Any = native()
    for _ in range(20):
        deep = it.MapIterator(deep, str)
    assert chain(deep) == " > ".join(["MapIterator.source"] * 11 + ["MapIterator"])


def test_a_restore_error_names_the_path_in_the_same_format() -> None:
    pipeline = it.MultiplexIterator(native(), [native(), it.MapIterator(native(), str)])
    state = pipeline.getstate()
    state["control"]["stage"] = "Other"
    with pytest.raises(StateMismatchError) as caught:
        pipeline.setstate(state)
    assert str(caught.value).startswith(
        "checkpoint does not fit this pipeline at MultiplexIterator.sources[0] > "
        "NativeCheckpointableIterator: expected a state of NativeCheckpointableIterator"
    )
    state = pipeline.getstate()
    state["sources"][1]["source"]["stage"] = "Other"
    with pytest.raises(StateMismatchError) as caught:
        pipeline.setstate(state)
    assert str(caught.value).startswith(
        "checkpoint does not fit this pipeline at MultiplexIterator.sources[2] > "
        "MapIterator.source > NativeCheckpointableIterator: "
    )


def test_a_stage_shows_its_class_and_the_arguments_it_was_built_with() -> None:
    source = it.NativeCheckpointableIterator(["1", "2"])
    assert repr(source) == "NativeCheckpointableIterator(iterable=['1', '2'])"
    assert repr(it.MapIterator(source, parse)) == (
        "MapIterator(source_iterator=NativeCheckpointableIterator, transform=parse)"
    )
    mapped = it.MapIterator(source, functools.partial(parse), on_error="skip")
    assert repr(mapped) == (
        "MapIterator(source_iterator=NativeCheckpointableIterator, transform=partial(parse), "
        "on_error='skip')"
    )
    assert repr(it.ZipIterator(source, native())) == (
        "ZipIterator(NativeCheckpointableIterator, NativeCheckpointableIterator)"
    )
    assert repr(it.MultiplexIterator(native(), [native(), native()])) == (
        "MultiplexIterator(control_iterator=NativeCheckpointableIterator, "
        "source_iterators=[NativeCheckpointableIterator, Nativ...])"
    )


def test_a_long_argument_is_cut_in_a_stage_repr() -> None:
    chunks = [f"/data/chunk-{n:05d}.jsonl.gz" for n in range(99)]
    text = repr(it.NativeCheckpointableIterator(chunks))
    assert text.startswith("NativeCheckpointableIterator(iterable=['/data/chunk-")
    assert len(text) <= len("NativeCheckpointableIterator(iterable=)") + 40
