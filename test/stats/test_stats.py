"""Per-stage statistics (`infinibatch_like.stats`): counters, reports, headspace, plots."""

from __future__ import annotations

import functools
import itertools
import json
import time
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from _counting import Counter
from _recipes import build_source, build_stage, recipes
from conftest import S3Bucket
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import stats
from infinibatch_like._core.graph import stages, walk
from infinibatch_like._core.stage import Stage
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import read_lines
from infinibatch_like.testing import assert_checkpointable

SLOW_S = 0.002


def add_one(x: int) -> int:
    return x + 1


def slow(x: int) -> int:
    time.sleep(SLOW_S)
    return x


def double(x: int) -> int:
    return 2 * x


def chain_with_slow_middle(
    items: int, background: str | None, method: tuple[str, str | None]
) -> tuple[it.CheckpointableIterator[Any], str]:
    """source > cheap map > slow map (2 ms) > [background stage] > cheap map > batches;
    returns the pipeline and the slow stage's path."""
    mode, start_method = method
    source = it.NativeCheckpointableIterator(list(range(items)))
    slow_stage: it.CheckpointableIterator[int] = it.MapIterator(
        it.MapIterator(source, add_one), slow
    )
    if background == "prefetch":
        middle: it.CheckpointableIterator[int] = it.PrefetchIterator(
            slow_stage, 16, mode=mode, start_method=start_method
        )
        path = (
            "FixedBatchIterator.source > MapIterator.source > PrefetchIterator.source > MapIterator"
        )
    elif background == "parallel":
        middle = it.ParallelMapIterator(
            slow_stage, double, 2, 4, mode=mode, start_method=start_method
        )
        path = (
            "FixedBatchIterator.source > MapIterator.source > ParallelMapIterator.source > "
            "MapIterator"
        )
    else:
        middle = slow_stage
        path = "FixedBatchIterator.source > MapIterator.source > MapIterator"
    return it.FixedBatchIterator(it.MapIterator(middle, double), 8), path


BACKGROUNDS = [
    (None, ("thread", None)),
    ("prefetch", ("thread", None)),
    ("prefetch", ("process", "fork")),
    ("prefetch", ("process", "spawn")),
    ("parallel", ("thread", None)),
    ("parallel", ("process", "fork")),
    ("parallel", ("process", "spawn")),
]


@pytest.mark.parametrize(("background", "method"), BACKGROUNDS)
def test_report_names_the_slow_stage(background: str | None, method: Any) -> None:
    pipeline, slow_path = chain_with_slow_middle(120, background, method)
    with pipeline:
        stats.enable(pipeline)
        batches = list(pipeline)
        entries = stats.collect(pipeline)
        text = stats.report(pipeline)
    assert sum(len(batch) for batch in batches) == 120
    busiest = stats.limiting(entries)
    assert busiest is not None
    assert busiest["path"] == slow_path, text
    assert busiest["share"] > 0.8, text
    assert 0.9 * 120 * SLOW_S <= busiest["self_s"] <= busiest["wall_s"]  # slept, timed exactly
    assert f"data-bound; limiting stage: {slow_path}" in text
    # every item was counted, also those counted in a worker process and sent back
    stages = 5 if background is None else 6
    assert [entry["items_out"] for entry in entries] == [15] + [120] * (stages - 1)
    if background == "prefetch" and method[0] == "process":
        assert entries[3]["runs_in"] == (
            "worker process of FixedBatchIterator.source > MapIterator.source > PrefetchIterator"
        )


def test_parallel_map_workers_busy_time_names_the_parallel_map() -> None:
    source = it.NativeCheckpointableIterator(list(range(60)))
    pipeline = it.ParallelMapIterator(it.MapIterator(source, add_one), slow, 2, 3, mode="thread")
    with pipeline:
        stats.enable(pipeline)
        assert len(list(pipeline)) == 60
        root, *_ = entries = stats.collect(pipeline)
    assert root["workers"] == 2
    assert 60 * SLOW_S <= root["worker_busy_s"] <= 2 * root["wall_s"]
    assert root["in_flight"] == 0
    busiest = stats.limiting(entries)
    assert busiest is not None
    assert busiest["path"] == "ParallelMapIterator"


def test_training_loop_bound_pipeline_is_called_so() -> None:
    pipeline = it.MapIterator(it.NativeCheckpointableIterator(list(range(40))), add_one)
    stats.enable(pipeline)
    for _ in pipeline:
        time.sleep(SLOW_S)  # the "training step"
    entries = stats.collect(pipeline)
    assert stats.consumer_wait_share(entries) < 0.05
    assert "the training loop is the limit, not the data" in stats.report(pipeline)


# -- off means off -------------------------------------------------------------------------


def iterator_types(pipeline: it.CheckpointableIterator[Any]) -> list[str]:
    return [type(s._iterator).__name__ for s in stages(pipeline) if isinstance(s, Stage)]


def mixed_pipeline() -> it.CheckpointableIterator[Any]:
    source = it.InfinitePermutationSourceIterator(list(range(30)), seed=3)
    shuffled = it.BlockwiseShuffleIterator(it.MapIterator(source, add_one), 7, 1)
    parallel = it.ParallelMapIterator(shuffled, double, 2, 3, mode="thread")
    prefetched = it.PrefetchIterator(parallel, 10, mode="thread")
    return it.BucketedReadaheadBatchIterator(prefetched, 20, key=abs, batch_size=4, seed=2)


def test_off_runs_the_stages_own_iterators_without_wrappers() -> None:
    with mixed_pipeline() as pipeline:
        plain = iterator_types(pipeline)
        assert "chain" not in plain
        assert all(stage._probe is None for stage in stages(pipeline) if isinstance(stage, Stage))
        next(pipeline)
        stats.enable(pipeline)
        assert set(iterator_types(pipeline)) == {"chain"}
        next(pipeline)
        stats.disable(pipeline)
        assert iterator_types(pipeline) == plain
        assert all(stage._probe is None for stage in stages(pipeline) if isinstance(stage, Stage))
        with pytest.raises(ValueError, match=r"stats.collect: statistics are off .*enable"):
            stats.collect(pipeline)


def test_enabled_context_switches_off_after_the_block() -> None:
    pipeline = mixed_pipeline()
    with stats.enabled(pipeline, sample_every=4):
        next(pipeline)
        assert stats.collect(pipeline)[0]["items_out"] == 1
    assert "chain" not in iterator_types(pipeline)
    pipeline.close()


def test_enable_checks_its_argument() -> None:
    with pytest.raises(ValueError, match=r"stats\.enable: sample_every must be >= 1, got 0"):
        stats.enable(mixed_pipeline(), sample_every=0)


# -- statistics never enter checkpoints ----------------------------------------------------


def test_states_and_items_are_the_same_with_and_without_statistics() -> None:
    with mixed_pipeline() as plain, mixed_pipeline() as measured:
        stats.enable(measured, sample_every=3)
        for step in range(120):
            assert plain.getstate() == measured.getstate()
            assert next(plain) == next(measured)
            if step == 50:  # a restore keeps counting
                state = measured.getstate()
                measured.setstate(json.loads(json.dumps(state)))
                plain.setstate(state)
        assert stats.collect(measured)[0]["items_out"] == 120


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_contract_holds_with_statistics_on(index: int) -> None:
    def factory() -> it.CheckpointableIterator[Any]:
        pipeline = [
            mixed_pipeline,
            lambda: it.WindowedIterator(
                it.SelectManyIterator(it.NativeCheckpointableIterator([[1, 2], [], [3]] * 9)), 3
            ),
            lambda: it.WeightedMultiplexIterator(
                [it.NativeCheckpointableIterator(list(range(40))), it.RandomIterator(seed=1)],
                [1, 2],
                seed=5,
            ),
            lambda: it.SelectManyIterator(  # chunks read ahead in timed threads
                it.NativeCheckpointableIterator([[1, 2], [], [3, 4, 5]] * 9), read_ahead=2
            ),
        ][index]()
        stats.enable(pipeline, sample_every=2)
        return pipeline

    assert_checkpointable(factory, max_items=40, check_damage=False, check_torch=False)


# -- counters add up -----------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    recipe=recipes(),
    sample_every=st.integers(1, 9),
    take=st.integers(0, 60),
    restore_at=st.integers(0, 60),
)
def test_counters_add_up_over_random_chains(
    recipe: Any, sample_every: int, take: int, restore_at: int
) -> None:
    pipeline = build_source(recipe.source)
    for spec in recipe.stages:  # a counting map after every stage: the ground truth
        pipeline = it.MapIterator(build_stage(pipeline, spec), Counter())
    pipeline = it.MapIterator(pipeline, Counter())
    stats.enable(pipeline, sample_every=sample_every)
    consumed = 0
    for step in range(take):
        if step == restore_at:  # counting goes on across restores
            pipeline.setstate(pipeline.getstate())
        try:
            next(pipeline)
        except StopIteration:
            break
        consumed += 1
    entries = stats.collect(pipeline)
    assert entries[0]["items_out"] == consumed
    upstream = [place.stage for place in walk(pipeline)]
    assert [type(stage).__name__ for stage in upstream] == [entry["stage"] for entry in entries]
    checked = 0
    for index, stage in enumerate(upstream):
        counter = getattr(stage, "_transform", None)
        if isinstance(counter, Counter):
            below = entries[index + 1]  # the counted stage: the map's only source
            assert entries[index]["items_out"] == counter.calls
            assert entries[index]["items_in"] == counter.calls
            assert below["items_out"] == counter.calls  # items out of it = items into the next
            checked += 1
    assert checked == len(recipe.stages) + 1


@pytest.mark.parametrize("method", [("thread", None), ("process", "fork"), ("process", "spawn")])
def test_counters_of_worker_processes_come_back(method: Any) -> None:
    source = it.NativeCheckpointableIterator(list(range(500)))
    pipeline = it.PrefetchIterator(
        it.FixedBatchIterator(it.MapIterator(source, add_one), 3),
        8,
        mode=method[0],
        start_method=method[1],
    )
    with pipeline:
        stats.enable(pipeline, sample_every=5)
        assert len(list(pipeline)) == 167
        entries = stats.collect(pipeline)
    assert [(e["items_in"], e["items_out"]) for e in entries] == [
        (167, 167),
        (500, 167),
        (500, 500),
        (None, 500),
    ]
    assert all(entry["time_s"] is not None and entry["time_s"] >= 0 for entry in entries)
    assert entries[0]["worker_busy_s"] == entries[1]["time_s"]


# -- multi-source tree, flat dict ----------------------------------------------------------


NATIVE = "NativeCheckpointableIterator"


def test_multi_source_stages_form_a_tree_and_flat_names_them() -> None:
    first = it.MapIterator(it.NativeCheckpointableIterator(list(range(50))), add_one)
    second = it.RandomIterator(seed=1)
    pipeline = it.WeightedMultiplexIterator([first, second], [1, 1], seed=3)
    stats.enable(pipeline)
    list(islice(pipeline, 30))
    entries = stats.collect(pipeline)
    assert [(e["path"], e["depth"]) for e in entries] == [
        ("WeightedMultiplexIterator", 0),
        ("WeightedMultiplexIterator.sources[0] > MapIterator", 1),
        ("WeightedMultiplexIterator.sources[0] > MapIterator.source > " + NATIVE, 2),
        ("WeightedMultiplexIterator.sources[1] > RandomIterator", 1),
    ]
    assert entries[0]["items_in"] == entries[1]["items_out"] + entries[3]["items_out"] >= 30
    flat = stats.flat(pipeline, prefix="loader/")
    assert flat["loader/WeightedMultiplexIterator/items_out"] == 30
    assert (
        flat[
            "loader/WeightedMultiplexIterator[0]/MapIterator/NativeCheckpointableIterator/items_out"
        ]
        == entries[2]["items_out"]
    )
    assert 0 <= flat["loader/consumer_wait_share"] <= 1
    assert all(isinstance(value, float) for value in flat.values())
    tree = [line[:52].rstrip() for line in stats.report(pipeline).splitlines()[1:5]]
    assert tree == [
        "WeightedMultiplexIterator",
        "   └─ MapIterator",
        "      └─ NativeCheckpointableIterator",
        "   └─ RandomIterator",
    ]


# -- headspace -----------------------------------------------------------------------------


def squares_pipeline() -> it.CheckpointableIterator[int]:
    return it.MapIterator(it.NativeCheckpointableIterator(list(range(100))), double)


def test_headspace_drains_a_copy_without_disturbing_the_pipeline() -> None:
    pipeline = squares_pipeline()
    assert list(islice(pipeline, 10)) == list(range(0, 20, 2))
    state = pipeline.getstate()
    rate = stats.headspace(pipeline, items=50, keep=5)
    assert pipeline.getstate() == state
    assert next(pipeline) == 20
    assert rate.items == 50
    assert rate.kept == [20, 22, 24, 26, 28]
    assert rate.per_s > 0
    from_start = stats.headspace(squares_pipeline, items=500)
    assert from_start.items == 100  # the stream ends first
    calls: list[int] = []
    consumer = stats.consumer_rate(calls.append, rate.kept, steps=12)
    assert consumer.items == 12
    assert calls == (rate.kept * 3)[:12]


def test_headspace_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"stats\.headspace: items must be >= 1, got 0"):
        stats.headspace(squares_pipeline, items=0)
    with pytest.raises(TypeError, match=r"stats\.headspace: source must be callable"):
        stats.headspace(3, items=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stats\.consumer_rate: batches is empty"):
        stats.consumer_rate(print, [], steps=1)


# -- history and plot ----------------------------------------------------------------------


def test_history_shares_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pipeline, slow_path = chain_with_slow_middle(60, None, ("thread", None))
    stats.enable(pipeline)
    history = stats.History(pipeline)
    history.record()
    for batch in itertools.islice(pipeline, 3):
        assert batch
        history.record()
    times, shares = history.shares()
    assert len(times) == 3
    assert times == sorted(times)
    for index in range(3):
        assert sum(series[index] for series in shares.values()) == pytest.approx(1.0)
        assert shares[slow_path][index] > 0.8
    path = tmp_path / "shares.png"
    history.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


READ_TIMES: list[float] = []


def read_slowly(chunk: int) -> list[int]:
    start = time.perf_counter()
    time.sleep(10 * SLOW_S)
    READ_TIMES.append(time.perf_counter() - start)
    return list(range(chunk * 1000, chunk * 1000 + 1000))


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_rare_long_steps_are_timed_in_full(read_ahead: int) -> None:
    """A chunk read every 1,000 fast items: sampling alone would catch few of them."""
    READ_TIMES.clear()
    chunks = it.NativeCheckpointableIterator(list(range(12)))
    lines = it.SelectManyIterator(chunks, read_slowly, read_ahead=read_ahead)
    pipeline = it.FixedBatchIterator(it.BlockwiseShuffleIterator(lines, 3000, 1), 100)
    stats.enable(pipeline, sample_every=64)
    assert sum(len(batch) for batch in pipeline) == 12000
    entries = stats.collect(pipeline)
    reading = entries[2]
    assert reading["stage"] == "SelectManyIterator"
    if read_ahead == 0:  # the reads happen in this thread: all of their time is counted
        assert reading["self_s"] == pytest.approx(sum(READ_TIMES), rel=0.2)
        busiest = stats.limiting(entries)
        assert busiest is not None
        assert busiest["stage"] == "SelectManyIterator"
    else:  # read in threads: what shows is the wait for them, at least for the first one
        assert reading["self_s"] >= READ_TIMES[0]
    assert entries[0]["time_s"] >= entries[1]["time_s"] >= reading["time_s"]


# -- gauges: buffers and workers, read at collect time -------------------------------------


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def entry_of(pipeline: it.CheckpointableIterator[Any], stage: str) -> Any:
    (entry,) = [e for e in stats.collect(pipeline) if e["stage"] == stage]
    return entry


def chunk_of(chunk: int) -> list[int]:
    time.sleep(0.02)
    return list(range(10 * chunk, 10 * chunk + 10))


def test_read_ahead_full_when_the_consumer_stops_pulling() -> None:
    chunks = it.NativeCheckpointableIterator(list(range(8)))
    pipeline = it.SelectManyIterator(chunks, chunk_of, read_ahead=3)
    stats.enable(pipeline)
    assert next(pipeline) == 0
    wait_for(lambda: entry_of(pipeline, "SelectManyIterator")["in_flight"] == 0, "the reads")
    entry = entry_of(pipeline, "SelectManyIterator")
    assert entry["queue_fill"] == 1.0  # chunks 1, 2, 3 read and waiting
    assert entry["workers"] == 4  # three ahead, and chunk 0's reader
    assert entry["worker_busy_s"] >= 4 * 0.02  # the current chunk and the three ahead
    assert list(pipeline) == list(range(1, 80))
    entry = entry_of(pipeline, "SelectManyIterator")
    assert (entry["queue_fill"], entry["in_flight"]) == (0.0, 0)  # none left
    assert entry["worker_busy_s"] >= 8 * 0.02  # every read counted once it is done
    assert entry["worker_busy_s"] < entry["wall_s"] * 4 + 0.1


class GatedReader:
    """Reads chunk 0 at once and the others once `gate` is open (a threading.Event, or a
    file's path when the reader runs in a worker process)."""

    def __init__(self, gate: Any, item: Any = None) -> None:
        self.gate, self.item = gate, item

    def __call__(self, chunk: int) -> list[Any]:
        if chunk:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not self._open():
                time.sleep(0.005)
        if self.item is not None:
            return [self.item] * 40
        return list(range(10 * chunk, 10 * chunk + 10))

    def _open(self) -> bool:
        return bool(
            self.gate.is_set() if hasattr(self.gate, "is_set") else Path(self.gate).exists()
        )


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_slow_reader_shows_chunks_in_flight(prefetch: bool) -> None:
    import threading

    gate = threading.Event()
    chunks = it.NativeCheckpointableIterator(list(range(6)))
    lines = it.SelectManyIterator(chunks, GatedReader(gate), read_ahead=2)
    pipeline: it.CheckpointableIterator[int] = (
        it.PrefetchIterator(lines, 30, mode="thread") if prefetch else lines
    )
    # In this thread, the consumer is in chunk 0, and chunks 1 and 2 are being read; in
    # a worker thread, the worker waits for chunk 1 (current), and 2 and 3 are read.
    expected = 3 if prefetch else 2
    with pipeline:
        try:
            stats.enable(pipeline)
            assert next(pipeline) == 0
            reading = lambda: entry_of(pipeline, "SelectManyIterator")["in_flight"]  # noqa: E731
            wait_for(lambda: reading() == expected, f"{expected} chunks being read")
            time.sleep(0.05)
            entry = entry_of(pipeline, "SelectManyIterator")
            assert (entry["queue_fill"], entry["in_flight"]) == (0.0, expected)
            assert entry["worker_busy_s"] >= expected * 0.05  # reads in progress count
            text = stats.report(pipeline)
            assert f"buffer 0 % full, {expected} chunks in flight" in text
            assert "readers busy" in text
        finally:
            gate.set()
        assert list(pipeline) == list(range(1, 60))
        entry = entry_of(pipeline, "SelectManyIterator")
    assert (entry["queue_fill"], entry["in_flight"]) == (0.0, 0)
    assert entry["worker_busy_s"] >= expected * 0.05


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_read_ahead_gauges_come_back_from_a_worker_process(
    start_method: str, tmp_path: Path
) -> None:
    gate = tmp_path / "open"
    chunks = it.NativeCheckpointableIterator(list(range(4)))
    # Items of 16 KiB: the worker's outbox (1 item) and pipe soon hold all they can.
    reader = GatedReader(str(gate), bytes(16384))
    lines = it.SelectManyIterator(chunks, reader, read_ahead=2)
    pipeline = it.PrefetchIterator(lines, 1, start_method=start_method)
    with pipeline:
        stats.enable(pipeline)
        next(pipeline)  # its message says: chunk 0 read, chunks 1 and 2 being read
        entry = entry_of(pipeline, "SelectManyIterator")
        assert entry["runs_in"] == "worker process of PrefetchIterator"
        assert (entry["queue_fill"], entry["in_flight"], entry["workers"]) == (0.0, 2, 3)
        time.sleep(0.3)
        gate.touch()
        time.sleep(0.3)  # chunks 1 and 2 are read while the worker waits for room
        taken = 1
        while entry_of(pipeline, "SelectManyIterator")["queue_fill"] != 1.0:
            next(pipeline)  # the worker goes on in chunk 0 and reports now and then
            taken += 1
            assert taken < 40, "no report of a full read-ahead while in chunk 0"
        assert entry_of(pipeline, "SelectManyIterator")["in_flight"] == 0
        assert sum(1 for _ in pipeline) == 160 - taken
        entry = entry_of(pipeline, "SelectManyIterator")
    assert (entry["queue_fill"], entry["in_flight"]) == (0.0, 0)  # as sent with the end
    assert entry["worker_busy_s"] >= 2 * 0.3  # chunks 1 and 2 waited for the gate


@pytest.mark.parametrize(
    ("mode", "start_method", "in_main"),
    [
        ("thread", None, False),
        ("process", "fork", False),
        ("process", "fork", True),
        ("process", "spawn", False),
    ],
)
def test_prefetch_items_in_flight(mode: str, start_method: str | None, in_main: bool) -> None:
    source = it.NativeCheckpointableIterator(list(range(30)))
    pipeline = it.PrefetchIterator(
        source, 100, in_main, mode=mode, start_method=start_method, snapshot_every=7
    )
    with pipeline:
        stats.enable(pipeline)
        assert [next(pipeline) for _ in range(3)] == [0, 1, 2]
        # the worker produces the rest, which waits for the consumer
        wait_for(lambda: entry_of(pipeline, "PrefetchIterator")["in_flight"] == 27, "27 items")
        assert entry_of(pipeline, "PrefetchIterator")["queue_fill"] == pytest.approx(0.27)
        assert [next(pipeline) for _ in range(5)] == [3, 4, 5, 6, 7]
        assert entry_of(pipeline, "PrefetchIterator")["in_flight"] == 22
        state = pipeline.getstate()
        pipeline.setstate(state)  # a restarted worker counts from its restart
        assert next(pipeline) == 8
        wait_for(lambda: entry_of(pipeline, "PrefetchIterator")["in_flight"] == 21, "21 items")
        assert list(pipeline) == list(range(9, 30))
        entry = entry_of(pipeline, "PrefetchIterator")
    assert (entry["queue_fill"], entry["in_flight"]) == (0.0, 0)


def test_a_full_thread_prefetch_counts_the_batch_being_taken() -> None:
    pipeline = it.PrefetchIterator(it.RandomIterator(seed=1), 8, mode="thread")
    with pipeline:
        stats.enable(pipeline)
        next(pipeline)  # batches of 1, then of 2: four of them fill the 4 slots
        wait_for(lambda: entry_of(pipeline, "PrefetchIterator")["in_flight"] == 8, "8 items")
        assert entry_of(pipeline, "PrefetchIterator")["queue_fill"] == 1.0
        next(pipeline)  # half of a batch taken: its other item, and a new batch in the queue
        wait_for(lambda: entry_of(pipeline, "PrefetchIterator")["in_flight"] == 9, "9 items")
        assert entry_of(pipeline, "PrefetchIterator")["queue_fill"] == 1.0


# -- sharded pipelines ---------------------------------------------------------------------


def shard_with_slow_middle(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    source = it.NativeCheckpointableIterator(list(range(100 * shard, 100 * shard + 20)))
    return it.FixedBatchIterator(it.MapIterator(it.MapIterator(source, add_one), slow), 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_sharded_stages_are_pooled_per_worker_and_the_slow_one_named(workers: int) -> None:
    from infinibatch_like.distributed.sharded import ShardedIterator

    pipeline = ShardedIterator(
        shard_with_slow_middle, 8, 0, 1, workers=workers, start_method="fork"
    )
    with pipeline:
        stats.enable(pipeline)
        assert sum(len(batch) for batch in pipeline) == 160
        entries = stats.collect(pipeline)
        text = stats.report(pipeline)
    busiest = stats.limiting(entries)
    assert busiest is not None
    group = "ShardedIterator.source > _ShardGroup"
    if workers:  # the workers do the same work: either may be the busiest
        worker = busiest["path"][len("ShardedIterator.sources[") :][0]
        assert worker in "01"
        group = f"ShardedIterator.sources[{worker}] > PrefetchIterator.source > _ShardGroup"
    slow_pattern = f"{group}.sources[*] > FixedBatchIterator.source > MapIterator"
    assert busiest["path"] == slow_pattern, text
    copies = [e for e in entries if e["pattern"] == slow_pattern]
    assert len(copies) == 8 // max(1, workers)  # the shards of one worker
    assert [e["path"] for e in copies] == [
        f"{group}.sources[{index}] > FixedBatchIterator.source > MapIterator"
        for index in range(len(copies))
    ]
    assert busiest["items_out"] == sum(e["items_out"] for e in copies) == 20 * len(copies)
    assert busiest["self_s"] == pytest.approx(sum(e["self_s"] for e in copies))
    assert busiest["self_s"] >= 0.9 * len(copies) * 20 * SLOW_S
    # the slow stage does most of the work, shared evenly by the workers (shares rather
    # than a bound on each: other stages' CPU time grows on a loaded machine, sleeps do not)
    slow_suffix = "_ShardGroup.sources[*] > FixedBatchIterator.source > MapIterator"
    every_copy = [e for e in entries if e["pattern"].endswith(slow_suffix)]
    mine = sum(e["share"] for e in copies)
    theirs = sum(e["share"] for e in every_copy) - mine
    assert busiest["share"] == pytest.approx(mine)
    assert mine + theirs > 0.5, text
    if workers:
        assert abs(mine - theirs) <= 0.25 * (mine + theirs), text
    assert f"data-bound; limiting stage: {slow_pattern}" in text
    lines = text.splitlines()
    slow_lines = [
        line for line in lines if line.strip().startswith(f"└─ MapIterator x{len(copies)}")
    ]
    assert len(slow_lines) == 2 * max(1, workers)  # both maps, once per worker
    assert len(lines) == 2 + 1 + (2 if workers else 1) * max(1, workers) + 4 * max(1, workers)
    if workers:  # each worker's buffer, in the consumer
        feeds = [e for e in entries if e["stage"] == "PrefetchIterator"]
        assert [(e["queue_fill"], e["in_flight"]) for e in feeds] == [(0.0, 0)] * 2
        assert [e["items_out"] for e in feeds] == [24, 24]  # 20 batches, 4 shard ends each


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_gauges_of_a_parallel_map_in_a_worker_process(start_method: str) -> None:
    source = it.NativeCheckpointableIterator(list(range(80)))
    mapped = it.ParallelMapIterator(source, slow, 2, 4, mode="thread")  # 4 tasks in flight
    pipeline = it.PrefetchIterator(mapped, 1, start_method=start_method)
    with pipeline:
        stats.enable(pipeline)
        assert next(pipeline) == 0  # sent right after the first task's results: 4 more out
        entry = entry_of(pipeline, "ParallelMapIterator")
        assert entry["runs_in"] == "worker process of PrefetchIterator"
        assert (entry["queue_fill"], entry["in_flight"], entry["workers"]) == (1.0, 16, 2)
        assert list(pipeline) == list(range(1, 80))
        entry = entry_of(pipeline, "ParallelMapIterator")
    assert (entry["queue_fill"], entry["in_flight"]) == (0.0, 0)
    assert entry["worker_busy_s"] >= 80 * SLOW_S


def test_report_and_flat_count_the_reads_from_an_object_store(
    s3: S3Bucket, tmp_path: Path
) -> None:
    data = "".join(f"line {n}\n" for n in range(20000)).encode()
    refs = [s3.put(f"stats/{i}.txt", data) for i in range(2)]
    fetch = {"cache_dir": str(tmp_path), "range_size": 50_000, "ranges_from_size": 0}
    reader = functools.partial(read_lines, storage_options={"infinibatch_like": fetch})
    list(reader(refs[0]))  # before statistics are on: not counted
    pipeline = chunked_dataset_iterator(refs * 2, reader, 10, train=False, shuffle=False)
    stats.enable(pipeline)
    assert stats.storage(pipeline) == {"requests": 0, "bytes": 0, "cache_hits": 0,
                                       "cache_misses": 0, "cache_evicted": 0, "retries": 0}
    assert len(list(pipeline)) == 4 * 20000
    ranges = -(-len(data) // 50_000)
    expected = {"requests": ranges, "bytes": len(data), "cache_hits": 3, "cache_misses": 1,
                "cache_evicted": 0, "retries": 0}
    assert stats.storage(pipeline) == expected
    flat = stats.flat(pipeline)
    assert {key: flat[f"data/storage/{key}"] for key in expected} == expected
    last = stats.report(pipeline).splitlines()[-1]
    assert last == (f"storage (this process and its workers): {ranges} GET requests, "
                    f"{len(data) / 1e6:.1f} MB fetched, 0 retries; cache: 3 hits, 1 misses, "
                    "0 evicted")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_reads_of_a_prefetch_worker_process_are_counted_by_its_consumer(
    s3: S3Bucket, start_method: str
) -> None:
    data = "".join(f"line {n}\n" for n in range(20000)).encode()
    refs = [s3.put(f"stats/worker-{i}.txt", data) for i in range(2)]
    fetch = {"range_size": 50_000, "ranges_from_size": 0}
    reader = functools.partial(read_lines, storage_options={"infinibatch_like": fetch})
    list(reader(refs[0]))  # before statistics are on, in this process: not counted
    lines = chunked_dataset_iterator(refs, reader, 10, train=False, shuffle=False)
    pipeline = it.PrefetchIterator(lines, 100, start_method=start_method)
    with pipeline:
        stats.enable(pipeline)
        assert len(list(pipeline)) == 2 * 20000
        counts = stats.storage(pipeline)
        last = stats.report(pipeline).splitlines()[-1]
    ranges = -(-len(data) // 50_000)
    assert counts["requests"] == 2 * ranges  # read in the worker, reported at its end
    assert counts["bytes"] == 2 * len(data)
    assert last.startswith(f"storage (this process and its workers): {2 * ranges} GET requests")


def test_report_has_no_storage_line_without_remote_reads() -> None:
    pipeline = it.MapIterator(it.NativeCheckpointableIterator(list(range(10))), add_one)
    stats.enable(pipeline)
    list(pipeline)
    assert "storage" not in stats.report(pipeline)
    assert stats.flat(pipeline)["data/storage/requests"] == 0.0


# -- the limiting stage is the one the consumer waits for ----------------------------------


def nap(seconds: float, item: Any) -> Any:
    time.sleep(seconds)
    return item


def consumer_side(pipeline: it.CheckpointableIterator[Any]) -> it.CheckpointableIterator[Any]:
    """Three stages in the consumer's thread: 10 ms (the slowest), 5 ms and 5 ms per item.
    Behind them, a background stage whose workers do more work per item than any of
    them (12 ms) but keep ahead of the 20 ms the consumer takes per item."""
    slowest = it.MapIterator(pipeline, functools.partial(nap, 0.010))
    return it.MapIterator(
        it.MapIterator(slowest, functools.partial(nap, 0.005)), functools.partial(nap, 0.005)
    )


def limit_of(pipeline: it.CheckpointableIterator[Any], items: int) -> tuple[str, str]:
    with pipeline:
        stats.enable(pipeline)
        assert sum(1 for _ in pipeline) == items
        entries = stats.collect(pipeline)
        text = stats.report(pipeline)
    slowest = stats.limiting(entries)
    assert slowest is not None, text
    return slowest["path"], text


SLOWEST = "MapIterator.source > MapIterator.source > MapIterator"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_parallel_map_that_keeps_up_is_not_the_limit(mode: str) -> None:
    source = it.NativeCheckpointableIterator(list(range(30)))
    # 2 workers x 24 ms per item: 12 ms of work per item, and room to spare
    mapped = it.ParallelMapIterator(
        source, functools.partial(nap, 0.024), 2, 1, mode=mode, start_method="fork"
    )
    path, text = limit_of(consumer_side(mapped), 30)
    assert path == SLOWEST, text
    assert f"data-bound; limiting stage: {SLOWEST} (" in text


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_prefetcher_that_keeps_up_is_not_the_limit(mode: str) -> None:
    source = it.NativeCheckpointableIterator(list(range(30)))
    worker_side = it.MapIterator(source, functools.partial(nap, 0.012))
    prefetched = it.PrefetchIterator(worker_side, 30, mode=mode, start_method="fork")
    path, text = limit_of(consumer_side(prefetched), 30)
    assert path == SLOWEST, text


def shard_of_slow_items(shard: int, num_shards: int) -> it.CheckpointableIterator[Any]:
    source = it.NativeCheckpointableIterator(list(range(10 * shard, 10 * shard + 10)))
    return it.MapIterator(source, functools.partial(nap, 0.024))


def test_sharded_workers_that_keep_up_are_not_the_limit() -> None:
    from infinibatch_like.distributed.sharded import ShardedIterator

    sharded = ShardedIterator(shard_of_slow_items, 4, 0, 1, workers=2, start_method="fork")
    path, text = limit_of(consumer_side(sharded), 40)
    assert path == SLOWEST, text


def slow_chunk(chunk: int) -> list[int]:
    time.sleep(0.200)
    return list(range(4 * chunk, 4 * chunk + 4))


def test_a_chunk_read_ahead_that_keeps_up_is_not_the_limit() -> None:
    chunks = it.NativeCheckpointableIterator(list(range(12)))
    # 4 readers x 200 ms per chunk of 4 items: 12.5 ms of work per item, room to spare
    lines = it.SelectManyIterator(chunks, slow_chunk, read_ahead=3)
    path, text = limit_of(consumer_side(lines), 48)
    assert path == SLOWEST, text


def test_a_slow_stage_behind_a_prefetcher_is_the_limit() -> None:
    source = it.NativeCheckpointableIterator(list(range(30)))
    slow_one = it.MapIterator(source, functools.partial(nap, 0.040))
    prefetched = it.PrefetchIterator(slow_one, 30, mode="thread")
    path, text = limit_of(consumer_side(prefetched), 30)
    expected = f"{SLOWEST}.source > PrefetchIterator.source > MapIterator"
    assert path == expected, text


def test_a_collective_wait_is_reported_as_waiting_for_the_slow_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from _ranks import Member, ThreadGroup, run_ranks

    from infinibatch_like.distributed import EqualLengthIterator
    from infinibatch_like.distributed import ranks as distributed

    monkeypatch.setattr(
        distributed, "all_reduce_max", lambda flags, m: m.group.reduce(m.rank, flags)
    )
    monkeypatch.setattr(distributed, "rank_in", lambda member: member.rank)
    group = ThreadGroup(3)

    def rank(index: int) -> tuple[list[stats.StageStats], str]:
        source = it.NativeCheckpointableIterator(list(range(20)))
        step = functools.partial(nap, 0.010 if index == 2 else 0.0)  # rank 2 is slow
        pipeline = EqualLengthIterator(
            it.MapIterator(source, step), group=Member(group, index)
        )
        stats.enable(pipeline)
        assert len(list(pipeline)) == 20
        return stats.collect(pipeline), stats.report(pipeline)

    (entries, text), _, (slow_entries, _) = run_ranks(rank, 3)
    root = entries[0]
    assert root["stage"] == "EqualLengthIterator"
    assert root["slowest_rank"] == 2, text
    assert root["collective_s"] is not None
    assert root["collective_s"] > 0.5 * root["time_s"]
    assert root["stall_s"] < 0.1 * root["collective_s"]  # waiting, not work
    assert "waiting for other ranks (mostly for rank 2, the last to arrive)" in text
    assert "this rank's pipeline keeps up; the wait is for a slower rank" in text
    slowest = stats.limiting(slow_entries)  # rank 2 names its own slow stage
    assert slowest is not None
    assert slowest["path"] == "EqualLengthIterator.source > MapIterator"
