"""The shared-memory transport of worker processes: arrays and tensors arrive exactly as
pickle would deliver them, through shared memory, and no segment outlives its use."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _leaks import open_fds
from _streams import native
from _waiting import wait_until

import infinibatch_like.iterators as it
from infinibatch_like import WorkerError
from infinibatch_like.background import segments as shm_segments
from infinibatch_like.background import shm
from infinibatch_like.background.lifecycle import worker_pids

METHODS = multiprocessing.get_all_start_methods()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not shm.ENABLED, reason="the transport needs /dev/shm")


@pytest.fixture(autouse=True)
def _single_threaded_torch() -> Iterator[None]:
    """No intra-op threads in this process: a forked worker would inherit a broken pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def segments() -> set[str]:
    """The transport's segments in /dev/shm, except those of other programs' live
    processes (another test run, a benchmark): this process's and dead processes'."""
    names = set()
    for name in os.listdir(shm_segments.SHM_DIR):
        if name.startswith("ibl_"):
            pid = int(name.split("_")[1])
            if pid == os.getpid() or not os.path.exists(f"/proc/{pid}"):
                names.add(name)
    return names


def live_segments() -> set[str]:
    """Every segment of the transport in /dev/shm."""
    return {name for name in os.listdir(shm_segments.SHM_DIR) if name.startswith("ibl_")}


def arrays(i: int) -> dict[str, Any]:
    """Item `i`: arrays and tensors of every kind the transport meets, nested."""
    big = np.arange(40_000, dtype=np.float32).reshape(200, 200) + i
    return {
        "c": big,
        "fortran": np.asfortranarray(big.astype(np.int64)),
        "strided": [big[::2, ::-1]],  # not contiguous: pickle makes it C-contiguous
        "big_endian": (big.astype(">f8"),),
        "record": np.array([(i, 0.5)] * 10_000, dtype=[("a", "<i4"), ("b", "<f8")]),
        "zero_d": np.array(i),
        "empty": np.zeros((0, 5000)),
        "objects": np.array([{"i": i}] * 20_000, dtype=object),
        "small": np.arange(10) + i,
        "tensor": torch.arange(40_000, dtype=torch.float32).reshape(200, 200) + i,
        "transposed": (torch.arange(40_000, dtype=torch.int64).reshape(200, 200) + i).t(),
        "sliced": (torch.arange(90_000, dtype=torch.float32) + i)[10::3],
        "bf16": torch.full((50_000,), float(i), dtype=torch.bfloat16),
        "bool": torch.arange(100_000) % (i + 2) == 0,
        "grad": torch.zeros(20_000, requires_grad=True),
    }


def assert_same(got: Any, expected: Any) -> None:
    """Equal values and types; arrays: dtype, shape, strides, flags; tensors likewise."""
    assert type(got) is type(expected)
    if isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=False):
            assert_same(a, b)
    elif isinstance(expected, np.ndarray):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert got.strides == expected.strides
        assert got.flags.writeable == expected.flags.writeable
        if expected.dtype.hasobject:
            assert got.tolist() == expected.tolist()
        else:
            assert got.tobytes() == expected.tobytes()
    elif isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert got.stride() == expected.stride()
        assert got.requires_grad == expected.requires_grad
        assert got.detach().contiguous().view(torch.uint8).numpy().tobytes() == (
            expected.detach().contiguous().view(torch.uint8).numpy().tobytes()
        )
    else:
        assert got == expected


def via_shared_memory(value: Any) -> bool:
    """Whether an array's or tensor's data lies in a mapping of a transport segment."""
    if isinstance(value, torch.Tensor):
        address = value.data_ptr()
    elif value.size and not value.dtype.hasobject:
        address = value.__array_interface__["data"][0]
    else:
        return False
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/ibl_" in line:
                start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
                if start <= address < end:
                    return True
    return False


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stage", ["map", "prefetch", "map_in_prefetch"])
def test_items_arrive_as_pickle_delivers_them_large_arrays_through_shared_memory(
    method: str, stage: str
) -> None:
    before = segments()
    if stage == "map":
        pipeline: Any = it.ParallelMapIterator(native(6), arrays, 2, 2, start_method=method)
    elif stage == "prefetch":
        pipeline = it.PrefetchIterator(it.MapIterator(native(6), arrays), 4, start_method=method)
    else:
        inner = it.ParallelMapIterator(native(6), arrays, 2, 2, start_method=method)
        pipeline = it.PrefetchIterator(inner, 4, start_method=method)
    with pipeline:
        got = list(pipeline)
    expected = [pickle.loads(pickle.dumps(arrays(i), 5)) for i in range(6)]
    assert_same(got, expected)
    leaves = {k: v[0] if k in ("strided", "big_endian") else v for k, v in got[3].items()}
    shared = {key for key, value in leaves.items() if via_shared_memory(value)}
    large = {"c", "fortran", "strided", "big_endian", "record"}
    assert shared == large | {"tensor", "transposed", "sliced", "bf16", "bool"}
    assert segments() <= before  # each segment was unlinked as soon as it was mapped


def seen_in_shared_memory(array: np.ndarray) -> tuple[bool, int]:
    return via_shared_memory(array), int(array[-1])


@pytest.mark.parametrize("method", METHODS)
def test_the_items_sent_to_map_workers_go_through_shared_memory(method: str) -> None:
    before = segments()
    source = it.MapIterator(native(30), keep_forever)
    with it.ParallelMapIterator(source, seen_in_shared_memory, 2, 3, start_method=method) as p:
        assert list(p) == [(True, i) for i in range(30)]
    assert wait_until(lambda: segments() <= before), segments() - before


def keep_forever(i: int) -> np.ndarray:
    return np.full(100_000, i, dtype=np.int64)


def test_an_item_the_consumer_holds_is_never_overwritten() -> None:
    with it.PrefetchIterator(it.MapIterator(native(300), keep_forever), 8) as pipeline:
        held = [next(pipeline) for _ in range(5)]
        for i, item in enumerate(pipeline, start=5):  # dropped at once: segments are reused
            assert int(item[0]) == i
            assert int(item[-1]) == i
    assert [int(a[0]) for a in held] == [0, 1, 2, 3, 4]
    assert all((a == i).all() for i, a in enumerate(held))


def test_a_forked_child_dropping_its_copy_of_an_item_leaves_the_item_held() -> None:
    with it.PrefetchIterator(it.MapIterator(native(300), keep_forever), 8) as pipeline:
        held = [next(pipeline) for _ in range(3)]
        child = multiprocessing.get_context("fork").Process(target=held.clear)
        child.start()
        child.join()
        for i, item in enumerate(pipeline, start=3):
            assert int(item[0]) == i
    assert all((a == i).all() for i, a in enumerate(held))


def test_a_worker_runs_ahead_by_about_its_buffer_not_by_what_the_pipe_holds() -> None:
    with it.PrefetchIterator(it.MapIterator(native(500), keep_forever), 8) as pipeline:
        next(pipeline)
        time.sleep(1.0)  # small messages: the pipe alone would hold hundreds
        (pid,) = worker_pids()
        prefix = shm_segments.names_prefix(pid)
        unmapped = [name for name in live_segments() if name.startswith(prefix)]
        mapped = [name for name in shm._MAPPED if name.startswith(prefix)]
        assert len(unmapped) + len(mapped) <= 3 * 8
        assert [int(a[0]) for a in pipeline] == list(range(1, 500))


def test_held_items_hold_no_file_descriptors() -> None:
    with it.PrefetchIterator(it.MapIterator(native(60), keep_forever), 8) as pipeline:
        next(pipeline)
        before = open_fds()
        held = [next(pipeline) for _ in range(40)]
        assert open_fds() <= before
    assert [int(a[0]) for a in held] == list(range(1, 41))


def test_when_every_segment_is_held_arrays_are_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "MAX_SEGMENTS", 3)  # read by the forked worker
    with it.PrefetchIterator(it.MapIterator(native(12), keep_forever), 2, start_method="fork") as p:
        held = list(p)
    assert [int(a[7]) for a in held] == list(range(12))
    assert sum(map(via_shared_memory, held)) == 3


def test_a_full_dev_shm_falls_back_to_pickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    before = segments()
    monkeypatch.setattr(os, "posix_fallocate", full)  # in the forked worker too
    with it.PrefetchIterator(it.MapIterator(native(10), keep_forever), 4, start_method="fork") as p:
        held = list(p)
    assert [int(a[5]) for a in held] == list(range(10))
    assert not any(map(via_shared_memory, held))
    assert segments() <= before


def test_states_are_those_without_the_transport_and_restore_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def build() -> Any:
        return it.PrefetchIterator(
            it.ParallelMapIterator(native(40), keep_forever, 2, 3, start_method="fork"),
            5,
            snapshot_every=4,
            start_method="fork",
        )

    def states_and_items() -> tuple[list[Any], list[int]]:
        with build() as pipeline:
            states, items = [pipeline.getstate()], []
            for item in pipeline:
                items.append(int(item[0]))
                states.append(pipeline.getstate())
        return states, items

    states, items = states_and_items()
    with monkeypatch.context() as patch:
        patch.setattr(shm, "ENABLED", False)  # read by the forked workers
        assert states_and_items() == (states, items)
    assert items == list(range(40))
    with build() as resumed:
        resumed.setstate(states[13])
        assert [int(a[0]) for a in resumed] == items[13:]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ending", ["close", "gc", "unread"])
def test_no_segment_outlives_the_pipeline(method: str, ending: str) -> None:
    before = segments()
    pipeline: Any = it.PrefetchIterator(
        it.ParallelMapIterator(native(200), keep_forever, 2, 2, start_method=method),
        16,
        start_method=method,
    )
    first = next(pipeline)
    time.sleep(0.5)  # the workers fill their buffers: segments wait to be mapped
    if ending == "close":
        pipeline.close()
    elif ending == "gc":
        del pipeline
        gc.collect()
    else:  # read to the end, the worker lingers until everything was mapped
        assert len(list(pipeline)) == 199
    assert wait_until(lambda: segments() <= before), segments() - before
    assert int(first[0]) == 0  # still valid after the workers are gone


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_worker_leaves_no_segment(method: str) -> None:
    before = segments()
    pipeline = it.PrefetchIterator(
        it.MapIterator(native(500), keep_forever), 64, start_method=method
    )
    next(pipeline)
    time.sleep(0.5)
    (pid,) = worker_pids()
    assert any(name.startswith(shm_segments.names_prefix(pid)) for name in live_segments())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="died"):
        for _ in pipeline:
            pass
    pipeline.close()
    assert segments() <= before


CONSUMER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import infinibatch_like.iterators as it

    def item(i):
        return np.full(100_000, i)

    def double(array):
        return 2 * array

    if __name__ == "__main__":
        source = it.MapIterator(it.NativeCheckpointableIterator(list(range(1000))), item)
        inner = it.ParallelMapIterator(source, double, 2, 2, start_method=sys.argv[1])
        pipeline = it.PrefetchIterator(inner, 32, start_method=sys.argv[1])
        next(pipeline)
        print("ready", flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_consumer_leaves_no_segment(method: str, tmp_path: Any) -> None:
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    before = live_segments()
    env = {**os.environ, "PYTHONPATH": REPO}
    consumer = subprocess.Popen(
        [sys.executable, str(script), method], stdout=subprocess.PIPE, env=env, text=True
    )
    assert consumer.stdout is not None
    assert consumer.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    assert live_segments() - before  # segments wait in the workers' pipes
    consumer.kill()
    consumer.wait()
    assert wait_until(lambda: segments() <= before), segments() - before


PAIR = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import infinibatch_like.iterators as it
    from infinibatch_like.background.lifecycle import worker_pids

    def item(i):
        return np.full(100_000, i)

    if __name__ == "__main__":
        source = it.MapIterator(it.NativeCheckpointableIterator(list(range(1000))), item)
        pipeline = it.PrefetchIterator(source, 32, start_method=sys.argv[1])
        next(pipeline)
        print(*worker_pids(), flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("method", METHODS)
def test_a_worker_and_its_consumer_killed_at_once_leave_no_segment(
    method: str, tmp_path: Any
) -> None:
    script = tmp_path / "pair.py"
    script.write_text(PAIR)
    env = {**os.environ, "PYTHONPATH": REPO}
    consumer = subprocess.Popen(
        [sys.executable, str(script), method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert consumer.stdout is not None
    (worker,) = (int(pid) for pid in consumer.stdout.readline().split())
    prefix = shm_segments.names_prefix(worker)
    assert wait_until(lambda: any(name.startswith(prefix) for name in live_segments()))
    time.sleep(0.5)  # segments wait in the worker's pipe, not mapped
    for pid in (worker, consumer.pid):  # neither can unlink what the other left
        os.kill(pid, signal.SIGKILL)
    consumer.wait()
    left = lambda: {name for name in live_segments() if name.startswith(prefix)}  # noqa: E731
    assert wait_until(lambda: not left()), left()
