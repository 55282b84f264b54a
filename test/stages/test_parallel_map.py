"""ParallelMapIterator: MapIterator's output from worker processes, exact checkpoints, no
leaks, no hangs, nested inside and around a process PrefetchIterator."""

from __future__ import annotations

import functools
import gc
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from _items import lock_at_5
from _leaks import children, open_fds, open_pipes
from _streams import drain, native, split_by_checkpoint

import infinibatch_like.iterators as it
from infinibatch_like import WorkerError

pytestmark = pytest.mark.timeout(120)

METHODS = multiprocessing.get_all_start_methods()


def square(x: int) -> int:
    return x * x


def pid_of(x: int) -> tuple[int, int]:
    return x, os.getpid()


def explode_at_23(x: int) -> int:
    if x == 23:
        raise KeyError(f"no key {x}")
    return x


def wait_for_flag(flag: str, first_free: int, x: int) -> int:
    """Items below `first_free` are immediate; the others wait until `flag` exists."""
    while x >= first_free and not os.path.exists(flag):
        time.sleep(0.01)
    return x


def tokens(line: str) -> list[str]:
    return line.split()


class FailingSource(it.NativeCheckpointableIterator):
    """Raises OSError at item 31 (after yielding 0..30)."""

    def __init__(self) -> None:
        super().__init__(range(60))
        self._iterator = self._failing(self._iterator)

    def _restore(self, state: Any) -> None:
        super()._restore(state)
        self._iterator = self._failing(self._iterator)

    @staticmethod
    def _failing(items: Any) -> Any:
        for item in items:
            if item == 31:
                raise OSError("disk on fire")
            yield item


@pytest.mark.parametrize(("processes", "per_process"), [(1, 1), (2, 3), (3, 7), (2, 100)])
def test_same_output_as_map_iterator_with_exact_restores(processes: int, per_process: int) -> None:
    expected = list(it.MapIterator(native(150), square))

    def make() -> it.ParallelMapIterator:
        return it.ParallelMapIterator(native(150), square, processes, per_process,
                                      snapshot_every=10)

    with make() as pipeline:
        states, got = [], []
        for _ in expected:
            states.append(pipeline.getstate())
            got.append(next(pipeline))
        assert got == expected
        assert all(state["replay"] < 10 for state in states[10:])
        end = pipeline.getstate()
    for k in (0, 5, 77, 149):
        with make() as fresh:
            fresh.setstate(json.loads(json.dumps(states[k])))
            assert list(fresh) == expected[k:]
    with make() as fresh:
        fresh.setstate(end)
        assert list(fresh) == []
    assert not children()


@pytest.mark.parametrize("method", METHODS)
def test_every_start_method_gives_the_items_and_resumes_exactly(method: str) -> None:
    source = it.NativeCheckpointableIterator(["a b", "c", "d e f"] * 10)
    with it.ParallelMapIterator(source, tokens, 2, 4, start_method=method) as pipeline:
        first = [next(pipeline) for _ in range(7)]
        state = pipeline.getstate()
        rest = list(pipeline)
    assert first + rest == [line.split() for line in ["a b", "c", "d e f"] * 10]
    fresh = it.ParallelMapIterator(it.NativeCheckpointableIterator(["a b", "c", "d e f"] * 10),
                                   tokens, 2, 4, start_method=method)
    fresh.setstate(state)
    assert list(fresh) == rest
    fresh.close()
    assert not children()


def test_transform_runs_in_worker_processes() -> None:
    with it.ParallelMapIterator(native(40), pid_of, 2, 2) as pipeline:
        pids = {pid for _, pid in pipeline}
    assert os.getpid() not in pids


def test_results_stream_before_a_whole_round_is_done(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    # Items 0 and 1 are ready at once; the rest wait for the flag, which is only set
    # after the first item came out: waiting for a whole round would hang.
    transform = functools.partial(wait_for_flag, str(flag), 2)
    with it.ParallelMapIterator(native(12), transform, 2, 2) as pipeline:
        assert next(pipeline) == 0
        flag.touch()
        assert list(pipeline) == list(range(1, 12))


@pytest.mark.parametrize(
    ("tasks_in_flight", "expected"), [(None, (4 + 1) * 3), (1, (1 + 1) * 3), (5, (5 + 1) * 3)]
)
def test_tasks_in_flight_bounds_what_is_read_ahead(
    tasks_in_flight: int | None, expected: int
) -> None:
    pulled: list[int] = []
    source = it.MapIterator(native(100), lambda x: pulled.append(x) or x)
    with it.ParallelMapIterator(source, square, 2, 3, tasks_in_flight=tasks_in_flight) as stage:
        assert next(stage) == 0
        # Tasks are sent from next() only: tasks_in_flight tasks queued, in progress or
        # done, plus the one being consumed.
        time.sleep(0.2)
        assert len(pulled) == expected
        assert list(stage) == [x * x for x in range(1, 100)]


def test_bad_arguments_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="tasks_in_flight must be >= 1, got 0"):
        it.ParallelMapIterator(native(3), square, 1, 1, tasks_in_flight=0)
    with pytest.raises(ValueError, match="num_processes"):
        it.ParallelMapIterator(native(3), square, 0, 1)
    with pytest.raises(ValueError, match="num_items_per_process"):
        it.ParallelMapIterator(native(3), square, 1, 0)
    with pytest.raises(TypeError, match="transform"):
        it.ParallelMapIterator(native(3), 5, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source_iterator"):
        it.ParallelMapIterator(range(3), square, 1, 1)  # type: ignore[arg-type]


def test_unsendable_transform_under_spawn_is_named() -> None:
    lock = threading.Lock()  # a lambda is sent (cloudpickle); a lock in its closure is not
    transform = lambda x: (lock, x)[1]  # noqa: E731
    pipeline = it.ParallelMapIterator(native(5), transform, 2, 1, start_method="spawn")
    with pytest.raises(
        pickle.PicklingError, match=r"ParallelMapIterator.*transform.*lambda.*lock"
    ):
        next(pipeline)
    pipeline.close()
    assert not children()


def test_transform_error_comes_at_its_position_with_traceback() -> None:
    with it.ParallelMapIterator(native(60), explode_at_23, 2, 5) as pipeline:
        got: list[Any] = []
        with pytest.raises(KeyError, match="no key 23") as info:
            drain(pipeline, got)
        assert got == list(range(23))
        text = "".join(traceback.format_exception(info.value))
        assert "explode_at_23" in text
        assert "ParallelMapIterator" in text
    assert not children()


def test_source_error_comes_at_its_position() -> None:
    with it.ParallelMapIterator(FailingSource(), square, 2, 4) as pipeline:
        got: list[Any] = []
        with pytest.raises(OSError, match="disk on fire"):
            drain(pipeline, got)
        assert got == [x * x for x in range(31)]


def test_killed_worker_raises_a_clear_error() -> None:
    source = it.InfinitePermutationSourceIterator(list(range(10)), seed=1)
    with it.ParallelMapIterator(source, square, 2, 3) as pipeline:
        next(pipeline)
        victim = children()[0]
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"died unexpectedly \(killed by signal SIGKILL\)"):
            drain(pipeline, [])
    assert not children()


def test_nested_inside_and_around_a_process_prefetcher() -> None:
    lines = [f"w{i} x{i % 7} y" for i in range(120)]
    expected = [line.split() for line in lines]

    def inside() -> it.PrefetchIterator:
        return it.PrefetchIterator(
            it.ParallelMapIterator(it.NativeCheckpointableIterator(lines), tokens, 2, 5,
                                   snapshot_every=8),
            10, snapshot_every=6,
        )

    def around() -> it.ParallelMapIterator:
        return it.ParallelMapIterator(
            it.PrefetchIterator(it.NativeCheckpointableIterator(lines), 10, snapshot_every=6),
            tokens, 2, 5, snapshot_every=8,
        )

    for make in (inside, around):
        assert split_by_checkpoint(make, 45) == (expected[:45], expected[45:])
        assert not children()


def test_nothing_outlives_close_or_gc() -> None:
    warm = it.ParallelMapIterator(native(10), square, 2, 2)
    next(warm)
    warm.close()
    threads, fds, pipes = set(threading.enumerate()), open_fds(), open_pipes()
    for _ in range(3):
        pipeline = it.ParallelMapIterator(native(100), square, 2, 2)
        next(pipeline)
        pipeline.close()
    dropped = it.ParallelMapIterator(native(100), square, 2, 2)
    next(dropped)
    del dropped
    gc.collect()
    with it.ParallelMapIterator(native(100), square, 2, 2) as pipeline:
        next(pipeline)
        pipeline.setstate(None)  # a restore replaces the pool
        next(pipeline)
    assert not children()
    # Threads and sockets of other tests' servers (moto's request handlers) may end
    # meanwhile: no thread and no descriptor may be added, and every pipe is closed.
    assert set(threading.enumerate()) <= threads
    assert open_fds() <= fds
    assert open_pipes() == pipes
    with pytest.raises(RuntimeError):
        next(pipeline)


def test_pickled_mid_stream_continues() -> None:
    pipeline = it.ParallelMapIterator(native(30), square, 2, 3)
    head = [next(pipeline) for _ in range(11)]
    copied = pickle.loads(pickle.dumps(pipeline))
    assert head + list(copied) == [x * x for x in range(30)]
    copied.close()
    pipeline.close()


_SPAWNED = """
import sys
sys.path.insert(0, {repo!r})
import infinibatch_like.iterators as it

def square(x):
    return x * x

if __name__ == "__main__":
    kept = []
    for method in ("spawn", "forkserver"):
        for close in (True, False):
            source = it.NativeCheckpointableIterator(list(range(1000)))
            stage = it.ParallelMapIterator(
                it.PrefetchIterator(source, 8, True, start_method=method),
                square, 2, 5, start_method=method,
            )
            assert [next(stage) for _ in range(13)] == [x * x for x in range(13)]
            if close:
                stage.close()
            else:
                kept.append(stage)  # stopped at interpreter exit
    print("ok")
"""


@pytest.mark.skipif(
    not {"spawn", "forkserver"} <= set(METHODS), reason="needs spawn and forkserver"
)
def test_spawned_workers_leak_no_semaphores_or_warnings(tmp_path: Path) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(_SPAWNED.format(repo=str(Path(__file__).resolve().parents[2])))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "leaked" not in done.stderr, done.stderr
    assert "Warning" not in done.stderr, done.stderr


@pytest.mark.parametrize("method", METHODS)
def test_an_unpicklable_output_comes_after_every_item_before_it(method: str) -> None:
    def make() -> it.ParallelMapIterator:
        return it.ParallelMapIterator(native(12), lock_at_5, 2, 2, start_method=method)

    with make() as pipeline:
        got: list[Any] = []
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object") as info:
            drain(pipeline, got)
        assert got == [0, 1, 2, 3, 4]  # item 4 shares item 5's task
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert (
            "pickling the output returned by ParallelMapIterator's transform lock_at_5 on "
            "item 5 (source position 5)" in notes
        )
        assert "in a worker process of ParallelMapIterator" in notes
        assert "lock_at_5" in "".join(traceback.format_exception(info.value))
        state = pipeline.getstate()
    assert state["replay"] == 5
    with make() as fresh:  # the state points at the failing item
        fresh.setstate(state)
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
            next(fresh)
    assert not children()
