"""set_worker_gc: the garbage collector of every kind of worker process, under every start
method; the consumer's own collector untouched; cycles still collected; bad arguments."""

from __future__ import annotations

import gc
import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like import set_worker_gc
from infinibatch_like.background.worker_gc import DEFAULT, worker_gc
from infinibatch_like.distributed.sharded import ShardedIterator

pytestmark = pytest.mark.timeout(120)

METHODS = multiprocessing.get_all_start_methods()
STAGES = ["prefetch", "parallel map", "sharded"]


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    saved = worker_gc()
    yield
    set_worker_gc(saved.threshold, freeze=saved.freeze)


def collector(_: Any) -> tuple[int, int]:
    """(first-generation threshold, objects frozen) of the process that runs it."""
    return gc.get_threshold()[0], gc.get_freeze_count()


def numbers(count: int) -> it.CheckpointableIterator[int]:
    return it.NativeCheckpointableIterator(list(range(count)))


def reporting_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    return it.MapIterator(numbers(2), collector)


def run_in_workers(stage: str, method: str) -> set[tuple[int, int]]:
    """What `collector` says in the worker processes of `stage`."""
    pipeline: it.CheckpointableIterator[Any]
    if stage == "prefetch":
        pipeline = it.PrefetchIterator(
            it.MapIterator(numbers(3), collector), 2, mode="process", start_method=method
        )
    elif stage == "parallel map":
        pipeline = it.ParallelMapIterator(numbers(6), collector, 2, 1, start_method=method)
    else:
        pipeline = ShardedIterator(reporting_shard, 2, 0, 1, workers=2, start_method=method)
    with pipeline:  # type: ignore[attr-defined]
        return set(pipeline)


def fresh_interpreter_threshold() -> int:
    command = [sys.executable, "-c", "import gc; print(gc.get_threshold()[0])"]
    return int(subprocess.run(command, capture_output=True, check=True, text=True).stdout)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("method", METHODS)
def test_workers_start_with_a_high_threshold_and_frozen_start_up_objects(
    stage: str, method: str
) -> None:
    consumer_before = gc.get_threshold(), gc.get_freeze_count()
    reports = run_in_workers(stage, method)
    assert {threshold for threshold, _ in reports} == {50_000}
    assert all(frozen > 1000 for _, frozen in reports)  # at least the imported modules
    assert (gc.get_threshold(), gc.get_freeze_count()) == consumer_before


@pytest.mark.parametrize("method", METHODS)
def test_settings_reach_the_workers_started_after_the_call(method: str) -> None:
    set_worker_gc(1234, freeze=False)
    expected_frozen = gc.get_freeze_count() if method == "fork" else 0
    assert run_in_workers("prefetch", method) == {(1234, expected_frozen)}
    set_worker_gc(4321)
    reports = run_in_workers("parallel map", method)
    assert {threshold for threshold, _ in reports} == {4321}
    assert all(frozen > 1000 for _, frozen in reports)


@pytest.mark.parametrize("method", METHODS)
def test_none_leaves_the_workers_collector_as_python_sets_it(method: str) -> None:
    set_worker_gc(None, freeze=False)
    saved = gc.get_threshold()
    gc.set_threshold(777, *saved[1:])
    try:
        reports = run_in_workers("prefetch", method)
    finally:
        gc.set_threshold(*saved)
    inherited = 777 if method == "fork" else fresh_interpreter_threshold()
    expected_frozen = gc.get_freeze_count() if method == "fork" else 0
    assert reports == {(inherited, expected_frozen)}


class Cycle:
    """An object that refers to itself: only the collector frees it."""

    made = freed = 0

    def __init__(self) -> None:
        Cycle.made += 1
        self.me = self

    def __del__(self) -> None:
        Cycle.freed += 1


def uncollected_after_making_cycles(_: int) -> int:
    for _ in range(100):
        Cycle()
    return Cycle.made - Cycle.freed


@pytest.mark.parametrize("threshold", [2_000, None])
def test_cycles_are_still_collected_in_a_worker(threshold: int | None) -> None:
    """120,000 garbage cycles made in a worker: never more than the threshold's worth wait
    to be collected, and collections empty the backlog."""
    if threshold is not None:
        set_worker_gc(threshold)
    limit = DEFAULT.threshold if threshold is None else threshold
    assert limit is not None
    source = it.MapIterator(numbers(1200), uncollected_after_making_cycles)
    with it.PrefetchIterator(source, 100, mode="process", start_method="fork") as pipeline:
        waiting = list(pipeline)
    assert max(waiting) <= limit + 100
    assert min(waiting[len(waiting) // 2 :]) < limit // 4  # collections did run


@pytest.mark.parametrize("threshold", [0, -5, 1.5, "10", True])
def test_a_bad_threshold_is_refused_and_changes_nothing(threshold: Any) -> None:
    before = worker_gc()
    with pytest.raises(ValueError, match=r"set_worker_gc: threshold must be an int >= 1 or None"):
        set_worker_gc(threshold)
    assert worker_gc() == before


def test_a_bad_freeze_is_refused_and_changes_nothing() -> None:
    before = worker_gc()
    with pytest.raises(TypeError, match=r"set_worker_gc: freeze must be a bool, got 'yes'"):
        set_worker_gc(freeze="yes")  # type: ignore[arg-type]
    assert worker_gc() == before
