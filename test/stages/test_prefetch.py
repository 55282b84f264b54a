"""PrefetchIterator: same items, exact checkpoints, every start method, no leaks, no hangs."""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from typing import Any

import pytest
from _items import lock_at_5
from _leaks import children, open_fds, open_pipes
from _profiles import examples
from _streams import drain, split_by_checkpoint
from _waiting import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import WorkerError
from infinibatch_like.stages.prefetch import PrefetchIterator

pytestmark = pytest.mark.timeout(120)

METHODS = multiprocessing.get_all_start_methods()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINES = [[f"chunk{c}-line{i}" for i in range(c % 5 + 3)] for c in range(12)]


def read_lines(index: int) -> list[str]:
    return LINES[index]


def explode_at_17(x: int) -> int:
    if x == 17:
        raise ValueError(f"bad item {x}")
    return x


def slow(x: int) -> int:
    time.sleep(0.02)
    return x


def whose_pid(x: int) -> tuple[int, int]:
    return x, os.getpid()


def megabyte_tensor(i: int) -> Any:
    import torch

    return torch.full((262_144,), float(i))  # 1 MB of float32


def numpy_row(i: int) -> Any:
    import numpy as np

    return np.arange(i, i + 1000, dtype=np.int64)


MODES = ["process", "buffered", "thread"]  # "buffered": process, buffer_in_main_process=True


def prefetch(source: Any, size: int, mode: str = "process", **kwargs: Any) -> PrefetchIterator:
    if mode == "buffered":
        return PrefetchIterator(source, size, True, mode="process", **kwargs)
    return PrefetchIterator(source, size, mode=mode, **kwargs)


def chunk_pipeline(mode: str = "process", method: str | None = None, every: int = 4) -> Any:
    source = it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(12))), read_lines)
    return prefetch(source, 5, mode, start_method=method, snapshot_every=every)


def expected_lines() -> list[str]:
    return [line for chunk in LINES for line in chunk]


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize(
    ("method", "mode"), [(method, "process") for method in METHODS] + [(None, "buffered")]
)
def test_every_start_method_gives_the_source_and_restores_exactly(
    method: str | None, mode: str
) -> None:
    expected = expected_lines()
    with chunk_pipeline(mode, method) as pipeline:
        got, states = [], []
        for _ in expected:
            states.append(pipeline.getstate())
            got.append(next(pipeline))
        assert got == expected
        with pytest.raises(StopIteration):
            next(pipeline)
        end_state = pipeline.getstate()
    for k in (0, 1, 9, 23, len(expected) - 1):
        with chunk_pipeline(mode, method) as fresh:
            fresh.setstate(json.loads(json.dumps(states[k])))
            assert list(fresh) == expected[k:]
    with chunk_pipeline(mode, method) as fresh:
        fresh.setstate(end_state)
        assert list(fresh) == []
    assert not children()


def test_thread_mode_and_replay_bound() -> None:
    expected = expected_lines()
    with chunk_pipeline("thread", every=3) as pipeline:
        for k, line in enumerate(expected):
            state = pipeline.getstate()
            assert state["replay"] <= 3 or k < 3
            assert next(pipeline) == line
    assert [t for t in threading.enumerate() if t.name.startswith("infinibatch_like")] == []


@settings(max_examples=examples(0.4))
@given(
    length=st.integers(0, 400),
    buffer_size=st.integers(1, 600),
    every=st.integers(1, 150),
    data=st.data(),
)
def test_snapshots_inside_batches_restore_exactly_and_bound_the_replay(
    length: int, buffer_size: int, every: int, data: st.DataObject
) -> None:
    def build() -> PrefetchIterator:
        source = it.NativeCheckpointableIterator(list(range(length)))
        return PrefetchIterator(source, buffer_size, mode="thread", snapshot_every=every)

    states = []
    with build() as pipeline:
        for expected in range(length):
            state = pipeline.getstate()
            assert state["replay"] <= every
            states.append(state)
            assert next(pipeline) == expected
    for k in data.draw(st.lists(st.integers(0, max(0, length - 1)), max_size=3)):
        if k < length:
            with build() as fresh:
                fresh.setstate(states[k])
                assert list(fresh) == list(range(k, length))


def test_work_happens_in_another_process_or_thread() -> None:
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(20))), whose_pid)
    with PrefetchIterator(source, 4) as pipeline:
        pids = {pid for _, pid in pipeline}
    assert os.getpid() not in pids


def test_bad_arguments_are_refused_naming_the_argument() -> None:
    source = it.NativeCheckpointableIterator([1, 2])
    for bad in (0, -3):
        with pytest.raises(ValueError, match="buffer_size"):
            PrefetchIterator(source, bad)
    with pytest.raises(ValueError, match="mode"):
        PrefetchIterator(source, 2, mode="fiber")
    with pytest.raises(ValueError, match="start_method"):
        PrefetchIterator(source, 2, start_method="teleport")
    with pytest.raises(ValueError, match="source_iterator"):
        PrefetchIterator([1, 2], 2)  # type: ignore[arg-type]


def test_unsendable_pipeline_under_spawn_names_the_stage() -> None:
    lock = threading.Lock()  # a lambda is sent (cloudpickle); a lock in its closure is not
    source = it.MapIterator(it.NativeCheckpointableIterator([1, 2]), lambda x: (lock, x)[1])
    pipeline = PrefetchIterator(source, 2, start_method="spawn")
    with pytest.raises(
        pickle.PicklingError, match=r"PrefetchIterator.*MapIterator.*transform.*lambda.*lock"
    ):
        next(pipeline)
    pipeline.close()
    assert not children()


@pytest.mark.parametrize("mode", MODES)
def test_after_close_next_and_setstate_raise(mode: str) -> None:
    pipeline = chunk_pipeline(mode)
    next(pipeline)
    state = pipeline.getstate()
    pipeline.close()
    pipeline.close()
    with pytest.raises(RuntimeError):
        next(pipeline)
    with pytest.raises(RuntimeError):
        pipeline.setstate(state)


def test_empty_buffer_warning_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(3))), slow)
    with caplog.at_level(logging.WARNING, logger="infinibatch_like"), PrefetchIterator(
        source, 2, log_empty_buffer_warning=True
    ) as pipeline:
        assert list(pipeline) == [0, 1, 2]
    assert any("buffer is empty" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("mode", MODES)
def test_worker_exception_reaches_the_consumer_with_traceback_and_stage(mode: str) -> None:
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(30))), explode_at_17)
    with prefetch(source, 4, mode) as pipeline:
        got: list[Any] = []
        with pytest.raises(ValueError, match="bad item 17") as info:
            drain(pipeline, got)
        assert got == list(range(17))
        text = "".join(traceback.format_exception(info.value))
        assert "explode_at_17" in text
        assert "PrefetchIterator" in text
        assert len(getattr(info.value, "__notes__", [])) <= 1  # described once
        # the stage stays halted until a restore
        with pytest.raises(RuntimeError, match="stopped after an error"):
            next(pipeline)
    assert not children()


@pytest.mark.parametrize("mode", ["process", "buffered"])
def test_killed_worker_raises_a_clear_error(mode: str) -> None:
    source = it.InfinitePermutationSourceIterator(list(range(10)), seed=1)
    with prefetch(source, 8, mode) as pipeline:
        next(pipeline)
        (worker,) = children()
        os.kill(worker.pid, signal.SIGKILL)
        # the buffered items, then the error, never a hang
        with pytest.raises(WorkerError, match=r"died unexpectedly \(killed by signal SIGKILL\)"):
            drain(pipeline, [])
        # a restore starts a new worker
        pipeline.setstate(None)
        assert next(pipeline) == next(iter(it.InfinitePermutationSourceIterator(list(range(10)),
                                                                                  seed=1)))
    assert not children()


@pytest.mark.parametrize("mode", MODES)
def test_nothing_outlives_close_gc_or_the_context_manager(mode: str) -> None:
    warm = chunk_pipeline(mode)
    next(warm)
    warm.close()
    threads, fds, pipes, shm = set(threading.enumerate()), open_fds(), open_pipes(), shm_entries()
    for _ in range(3):
        pipeline = chunk_pipeline(mode)
        next(pipeline)
        pipeline.close()
    with chunk_pipeline(mode) as pipeline:
        next(pipeline)
    dropped = chunk_pipeline(mode)
    next(dropped)
    del dropped
    gc.collect()
    nested = prefetch(chunk_pipeline(mode), 3, mode)
    next(nested)
    nested.close()
    assert not children()
    # Threads and sockets of other tests' servers (moto's request handlers) may end
    # meanwhile: no thread and no descriptor may be added, and every pipe is closed.
    assert set(threading.enumerate()) <= threads
    assert open_fds() <= fds
    assert open_pipes() == pipes
    assert shm_entries() <= shm


def test_nested_prefetchers_restore_and_close_in_order() -> None:
    expected = expected_lines()

    def make() -> PrefetchIterator:
        return PrefetchIterator(chunk_pipeline(every=3), 4, snapshot_every=5)

    assert split_by_checkpoint(make, 11) == (expected[:11], expected[11:])
    assert not children()


def test_tensors_and_arrays_pass_between_processes() -> None:
    import numpy as np
    import torch

    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(200))), megabyte_tensor)
    with PrefetchIterator(source, 16) as pipeline:
        for i, tensor in enumerate(pipeline):
            assert tensor.shape == (262_144,)
            assert torch.equal(tensor, torch.full((262_144,), float(i)))
    assert i == 199
    arrays = it.MapIterator(it.NativeCheckpointableIterator(list(range(50))), numpy_row)
    with PrefetchIterator(arrays, 8) as pipeline:
        for i, array in enumerate(pipeline):
            np.testing.assert_array_equal(array, np.arange(i, i + 1000))
    assert not children()


def test_a_pickled_prefetcher_continues_the_stream() -> None:
    pipeline = chunk_pipeline()
    head = [next(pipeline) for _ in range(7)]
    copied = pickle.loads(pickle.dumps(pipeline))
    assert head + list(copied) == expected_lines()
    copied.close()
    pipeline.close()


_CHILD = """
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stacks, if it hangs
sys.path.insert(0, {repo!r})
import infinibatch_like.iterators as it
def double(x):
    return 2 * x
source = it.InfinitePermutationSourceIterator(list(range(100)), seed=1)
pipeline = it.ParallelMapIterator(it.PrefetchIterator(source, 16), double, 2, 4)
next(pipeline)
inner = it.PrefetchIterator(it.InfinitePermutationSourceIterator([1, 2, 3]), 4)
next(inner)
import multiprocessing
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
{tail}
"""


def _run_child(tail: str, interrupt: bool) -> None:
    script = _CHILD.format(repo=REPO, tail=textwrap.dedent(tail))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout is not None
    pids = [int(pid) for pid in child.stdout.readline().split()]
    assert len(pids) >= 3, child.stderr.read() if child.stderr else ""
    if interrupt:
        time.sleep(0.3)
        os.killpg(child.pid, signal.SIGINT)  # like Ctrl-C: the whole process group
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(child.pid, signal.SIGUSR1)
        time.sleep(1)
        os.killpg(child.pid, signal.SIGKILL)  # no process outlives the test
        stacks = child.stderr.read() if child.stderr else ""
        pytest.fail(f"the interpreter did not exit within 60 s; its threads:\n{stacks}")
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _exists(pid)]
        time.sleep(0.05)
    assert not alive, f"worker processes outlived their interpreter: {alive}"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited parent is reaped by init shortly; treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_interpreter_exit_stops_workers() -> None:
    _run_child("sys.exit(0)", interrupt=False)


def test_keyboard_interrupt_in_the_consumer_leaves_nothing_behind() -> None:
    _run_child("while True:\n    next(pipeline)\n    time.sleep(0.001)", interrupt=True)


UNPICKLED_IN: list[str] = []


def _unpickle_marker(value: int) -> int:
    UNPICKLED_IN.append(threading.current_thread().name)
    return value


class Marker:
    """Records the thread that unpickles it (in the consumer's process)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpickle_marker, (self.value,)


def marker(x: int) -> Marker:
    return Marker(x)


@pytest.mark.parametrize(
    ("buffered", "thread"),
    [(False, "MainThread"), (True, "infinibatch_like.PrefetchIterator.worker")],
)
def test_buffer_in_main_process_receives_ahead_in_a_thread(buffered: bool, thread: str) -> None:
    UNPICKLED_IN.clear()
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(40))), marker)
    with PrefetchIterator(source, 8, buffered) as pipeline:
        assert list(pipeline) == list(range(40))
    assert set(UNPICKLED_IN) == {thread}
    assert not children()


# -- messages of a worker process ---------------------------------------------------------

PRODUCED = multiprocessing.get_context("fork").Value("i", 0)


def counted_blob(i: int) -> bytes:
    with PRODUCED.get_lock():
        PRODUCED.value += 1
    return i.to_bytes(4, "little") + bytes(24_000)


def received_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The item count of every batch message the consumer receives from a worker process."""
    from infinibatch_like.background import channels

    sizes: list[int] = []
    receive = channels.ProcessChannel.receive

    def recording(self: Any) -> Any:
        message = receive(self)
        if isinstance(message, channels.Batch):
            sizes.append(len(message.items))
        return message

    monkeypatch.setattr(channels.ProcessChannel, "receive", recording)
    return sizes


def test_big_items_travel_a_few_per_message_small_ones_many(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 24 KB items: about 64 KB per message, so 2 items (a message of 16 would be 384 KB
    # and hold 16 items' thousands of objects alive in the consumer at once).
    sizes = received_sizes(monkeypatch)
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(300))), counted_blob)
    with PrefetchIterator(source, 64, start_method="fork") as pipeline:
        assert [int.from_bytes(blob[:4], "little") for blob in pipeline] == list(range(300))
    assert sum(sizes) == 300
    assert max(sizes) == 2
    sizes.clear()
    with PrefetchIterator(it.NativeCheckpointableIterator(list(range(300))), 64) as pipeline:
        assert list(pipeline) == list(range(300))
    assert max(sizes) == 16  # min(64, buffer_size // 4, snapshot_every)


def test_a_worker_process_keeps_about_buffer_size_big_items_ready() -> None:
    PRODUCED.value = 0
    source = it.MapIterator(it.NativeCheckpointableIterator(list(range(1000))), counted_blob)
    with PrefetchIterator(source, 64, start_method="fork") as pipeline:
        next(pipeline)
        assert wait_until(lambda: PRODUCED.value >= 64)
        before, deadline = -1, time.monotonic() + 10  # then until it stops producing
        while PRODUCED.value != before and time.monotonic() < deadline:
            before = PRODUCED.value
            time.sleep(0.3)
        # 64 waiting in the worker, what the pipe holds (64 KB: 2 items), the item
        # taken, the one blocked in put and the message being written.
        assert 64 <= PRODUCED.value <= 64 + 8
        assert [int.from_bytes(b[:4], "little") for b in pipeline] == list(range(1, 1000))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("buffered", [False, True])
def test_an_unpicklable_item_comes_after_every_item_before_it(method: str, buffered: bool) -> None:
    def make() -> PrefetchIterator:
        source = it.MapIterator(it.NativeCheckpointableIterator(list(range(12))), lock_at_5)
        return PrefetchIterator(source, 40, buffered, mode="process", start_method=method)

    with make() as pipeline:
        got: list[Any] = []
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object") as info:
            drain(pipeline, got)
        assert got == [0, 1, 2, 3, 4]  # the worker's messages: items 0, 1-2, 3-6, ...
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "pickling the source's item at position 5 to send it" in notes
        assert "in the worker process of PrefetchIterator" in notes
        state = pipeline.getstate()
    assert state["replay"] == 5
    with make() as fresh:
        fresh.setstate(state)
        with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
            next(fresh)
    assert not children()
