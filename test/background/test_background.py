"""The background layer under every start method: items before an error, lambdas and
closures, killed workers, leaks at exit, bounded replays, thread pools and early start."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _leaks import children
from _profiles import examples
from _streams import drain, native
from _waiting import HANG, wait_until, within
from hypothesis import given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError, WorkerError
from infinibatch_like.datasets import chunked_dataset_iterator

pytestmark = pytest.mark.timeout(180)

METHODS = multiprocessing.get_all_start_methods()
PICKLING_METHODS = [method for method in METHODS if method != "fork"]
REPO = str(Path(__file__).resolve().parents[2])


def fail_at(k: int, x: int) -> int:
    if x == k:
        raise ValueError(f"bad item {x}")
    return x


def same(x: int) -> int:
    return x


@pytest.fixture
def default_start_method() -> Iterator[Callable[[str], None]]:
    """Sets multiprocessing's default start method for the test (restored afterwards)."""
    original = multiprocessing.get_start_method(allow_none=True)
    yield lambda method: multiprocessing.set_start_method(method, force=True)
    multiprocessing.set_start_method(original, force=True)


# -- items before an error are delivered, and the state points at the failing one -----------

PREFETCH_MODES = [("process", m) for m in METHODS] + [("buffered", None), ("thread", None)]


def prefetcher(source: Any, mode: str, method: str | None) -> it.PrefetchIterator:
    if mode == "thread":
        return it.PrefetchIterator(source, 64, mode="thread")
    return it.PrefetchIterator(source, 64, mode == "buffered", start_method=method)



@pytest.mark.parametrize(
    "build",
    [
        lambda source: it.PrefetchIterator(source, buffer_size=2),
        lambda source: it.ParallelMapIterator(source, str, 2, 2, mode="thread"),
    ],
    ids=["prefetch", "parallel_map"],
)
def test_a_replay_past_the_end_of_the_source_is_a_mismatch_naming_the_stage(
    build: Callable[[Any], Any],
) -> None:
    """A checkpoint that replays more items than its source holds is refused (on the first
    item, once the worker has replayed), naming the stage, as a restore that skips past the
    end of a collection is."""
    pipeline = build(it.ChunkedSourceIterator([1, 2, 3]))
    state = {**pipeline.getstate(), "replay": 5}
    pipeline.close()
    fresh = build(it.ChunkedSourceIterator([1, 2, 3]))
    try:
        fresh.setstate(state)
        with pytest.raises(
            StateMismatchError,
            match=r"at (PrefetchIterator|ParallelMapIterator): the checkpoint skips 5 items of "
            r"its source after the snapshot, but there are only 3",
        ):
            next(fresh)
    finally:
        fresh.close()

@pytest.mark.parametrize(("mode", "method"), PREFETCH_MODES)
def test_prefetch_delivers_every_item_before_an_error_and_resumes_at_it(
    mode: str, method: str | None
) -> None:
    failing = it.MapIterator(native(80), functools.partial(fail_at, 37))
    with prefetcher(failing, mode, method) as pipeline:
        got: list[Any] = []
        with pytest.raises(ValueError, match="bad item 37"):
            drain(pipeline, got)
        assert got == list(range(37))
        state = json.loads(json.dumps(pipeline.getstate()))
    with prefetcher(it.MapIterator(native(80), same), "thread", None) as healed:
        healed.setstate(state)
        assert list(healed) == list(range(37, 80))  # the failing item is read again
    assert not children()


PARALLEL_MODES = [("process", m) for m in METHODS] + [("thread", None)]


@pytest.mark.parametrize(("mode", "method"), PREFETCH_MODES)
def test_a_worker_error_names_the_stage_whose_function_raised_it(
    mode: str, method: str | None
) -> None:
    # A MapIterator runs as a builtin map: no frame of it is on the stack, and the
    # innermost stage frame is the shuffle's. The note must still name the transform.
    mapped = it.MapIterator(native(40), functools.partial(fail_at, 13))
    shuffled = it.BlockwiseShuffleIterator(mapped, 8, seed=1)
    with (
        prefetcher(shuffled, mode, method) as prefetched,
        pytest.raises(ValueError, match="bad item 13") as raised,
    ):
        list(prefetched)
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1, notes
    assert notes[0].startswith("(raised by MapIterator's transform partial(fail_at) on item 13, ")
    assert "PrefetchIterator" in notes[0]
    assert "raised in BlockwiseShuffleIterator" not in notes[0]


def mapper(source: Any, transform: Any, mode: str, method: str | None) -> it.ParallelMapIterator:
    if mode == "thread":
        return it.ParallelMapIterator(source, transform, 3, 5, mode="thread")
    return it.ParallelMapIterator(source, transform, 3, 5, start_method=method)


@pytest.mark.parametrize(("mode", "method"), PARALLEL_MODES)
@pytest.mark.parametrize("where", ["source", "transform"])
def test_parallel_map_delivers_every_item_before_an_error_and_resumes_at_it(
    mode: str, method: str | None, where: str
) -> None:
    failing = functools.partial(fail_at, 23)
    if where == "source":
        pipeline = mapper(it.MapIterator(native(60), failing), same, mode, method)
    else:
        pipeline = mapper(it.MapIterator(native(60), same), failing, mode, method)
    with pipeline:
        got: list[Any] = []
        with pytest.raises(ValueError, match="bad item 23") as raised:
            drain(pipeline, got)
        assert got == list(range(23))
        state = json.loads(json.dumps(pipeline.getstate()))
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1, notes
    stage = "MapIterator" if where == "source" else "ParallelMapIterator"
    assert notes[0].startswith(f"(raised by {stage}'s transform partial(fail_at) on item 23")
    with mapper(it.MapIterator(native(60), same), same, "process", None) as healed:
        healed.setstate(state)
        assert list(healed) == list(range(23, 60))
    assert not children()


# -- lambdas and local closures under spawn and forkserver -----------------------------------


@pytest.mark.parametrize("method", PICKLING_METHODS)
def test_lambdas_and_closures_run_in_spawned_workers_and_restore_exactly(
    method: str, default_start_method: Callable[[str], None]
) -> None:
    default_start_method(method)  # chunked_dataset_iterator's prefetcher uses the default
    lines = {c: [f"c{c}-l{i}" for i in range(3 + c % 4)] for c in range(9)}
    suffix = "!"

    def exclaim(line: str) -> str:  # a local closure
        return line + suffix

    def build() -> it.ParallelMapIterator:
        corpus = chunked_dataset_iterator(
            list(range(9)),
            lambda chunk: lines[chunk],  # a lambda over a local dict
            buffer_size=7,
            seed=5,
            prefetch=True,
            train=True,
        )
        return it.ParallelMapIterator(corpus, exclaim, 2, 3, snapshot_every=5, start_method=method)

    reference = chunked_dataset_iterator(
        list(range(9)), lines.__getitem__, buffer_size=7, seed=5, train=True
    )
    expected = [next(reference) + "!" for _ in range(60)]
    with build() as pipeline:
        got, states = [], []
        for _ in expected:
            states.append(json.loads(json.dumps(pipeline.getstate())))
            got.append(next(pipeline))
    assert got == expected
    for k in (0, 17, 41):
        with build() as resumed:
            resumed.setstate(states[k])
            assert [next(resumed) for _ in range(60 - k)] == expected[k:]
    assert not children()


# -- a killed worker gives a WorkerError promptly, whatever it was writing --------------------


def megabyte(x: int) -> Any:
    import numpy as np

    array = np.zeros(131_072, dtype=np.int64)  # 1 MB, padded
    array[0] = x
    return array


KILLS = 4


def _kill_soon(pid: int, rng: random.Random) -> threading.Timer:
    timer = threading.Timer(rng.uniform(0.0, 0.15), os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def _items_until_worker_error(pipeline: Any, index: int) -> None:
    """Take items (counting up from `index`) until WorkerError; each `next()` returns or
    raises within 5 s."""
    while True:
        started = time.monotonic()
        try:
            item = next(pipeline)
        except WorkerError:
            assert time.monotonic() - started < 5, "the WorkerError came too late"
            return
        assert time.monotonic() - started < 5, "next() blocked"
        assert item[0] == index
        index += 1


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("buffered", [False, True])
def test_prefetch_worker_killed_while_sending_megabytes_gives_worker_error(
    method: str, buffered: bool
) -> None:
    rng = random.Random(f"{method}{buffered}")
    source = it.MapIterator(native(10_000), megabyte)
    with it.PrefetchIterator(source, 8, buffered, start_method=method) as pipeline:
        for _ in range(KILLS):
            pipeline.setstate(None)  # a new worker
            assert next(pipeline)[0] == 0
            (worker,) = children()
            timer = _kill_soon(worker.pid, rng)
            _items_until_worker_error(pipeline, 1)
            timer.join()
    assert not children()


@pytest.mark.parametrize("method", METHODS)
def test_parallel_map_worker_killed_while_sending_megabytes_gives_worker_error(
    method: str,
) -> None:
    rng = random.Random(method)
    with it.ParallelMapIterator(native(10_000), megabyte, 2, 2, start_method=method) as pipeline:
        for _ in range(KILLS):
            pipeline.setstate(None)
            assert next(pipeline)[0] == 0
            timer = _kill_soon(rng.choice(children()).pid, rng)
            _items_until_worker_error(pipeline, 1)
            timer.join()
    assert not children()


def megabyte_sigterm_blocked(x: int) -> Any:
    """1 MB items, from a worker whose main thread (like one where a library blocked
    signals) cannot take SIGTERM: the signal lands on another of its threads."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    return megabyte(x)


def _prefetched_megabytes(method: str) -> Any:
    source = it.MapIterator(native(10_000), megabyte_sigterm_blocked)
    return it.PrefetchIterator(source, 2, start_method=method)


def _parallel_megabytes(method: str) -> Any:
    source = native(10_000)
    return it.ParallelMapIterator(source, megabyte_sigterm_blocked, 2, 2, start_method=method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("build", [_prefetched_megabytes, _parallel_megabytes])
def test_close_stops_workers_blocked_writing_whatever_thread_gets_the_sigterm(
    method: str, build: Callable[[str], Any]
) -> None:
    pipeline = build(method)
    assert next(pipeline)[0] == 0
    time.sleep(0.5)  # the workers fill their pipes, then block writing the next result
    started = time.monotonic()
    pipeline.close()
    assert time.monotonic() - started < 2, "close() waited for the workers' stop timeout"
    assert not children()


_SIGTERMED = """
import signal, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
import infinibatch_like.iterators as it

def megabyte(x):
    return np.full(131_072, x, dtype=np.int64)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # a trainer's graceful stop
    source = it.NativeCheckpointableIterator(list(range(100_000)))
    pipeline = it.ParallelMapIterator(source, megabyte, 2, 2, start_method={method!r})
    next(pipeline)
    import multiprocessing
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    try:
        for _ in pipeline:  # until the WorkerError, or the SIGTERM
            pass
    except Exception:
        time.sleep(60)  # after the WorkerError, the SIGTERM must still stop this process
"""


@pytest.mark.parametrize("method", METHODS)
def test_consumer_exits_promptly_on_sigterm_after_a_worker_was_killed(
    method: str, tmp_path: Path
) -> None:
    script = tmp_path / "sigtermed.py"
    script.write_text(_SIGTERMED.format(repo=REPO, method=method))
    child = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    pids = [int(pid) for pid in child.stdout.readline().split()]
    assert len(pids) == 2, child.stderr.read() if child.stderr else ""
    rng = random.Random(method)
    time.sleep(rng.uniform(0.0, 0.2))  # at a random moment of the stream of 1 MB results
    os.kill(rng.choice(pids), signal.SIGKILL)
    time.sleep(rng.uniform(0.0, 0.5))
    os.kill(child.pid, signal.SIGTERM)
    started = time.monotonic()
    child.wait(timeout=30)
    assert time.monotonic() - started < 10
    assert child.returncode == 3
    deadline = time.monotonic() + 5
    while any(_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_exists(pid) for pid in pids)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


# -- nothing leaked or printed at exit, every nesting, every start method --------------------

_NESTED = """
import sys
sys.path.insert(0, {repo!r})
import infinibatch_like.iterators as it

def square(x):
    return x * x

def source():
    return it.NativeCheckpointableIterator(list(range(200)))

if __name__ == "__main__":
    m = {method!r}
    nestings = [
        lambda: it.PrefetchIterator(it.PrefetchIterator(source(), 8, start_method=m), 8,
                                    start_method=m),
        lambda: it.PrefetchIterator(it.ParallelMapIterator(source(), square, 2, 3,
                                                           start_method=m), 8, start_method=m),
        lambda: it.ParallelMapIterator(it.PrefetchIterator(source(), 8, start_method=m),
                                       square, 2, 3, start_method=m),
        lambda: it.PrefetchIterator(it.PrefetchIterator(source(), 8, True, start_method=m), 8,
                                    True, start_method=m),
    ]
    for build in nestings:
        with build() as pipeline:
            head = [next(pipeline) for _ in range(30)]
        assert head in (list(range(30)), [x * x for x in range(30)]), head
    kept = nestings[1]()  # left running: stopped at interpreter exit
    next(kept)
"""


@pytest.mark.parametrize("method", METHODS)
def test_every_nesting_exits_cleanly_with_nothing_printed(method: str, tmp_path: Path) -> None:
    script = tmp_path / "nested.py"
    script.write_text(_NESTED.format(repo=REPO, method=method))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")


# -- the replay of a state is bounded by snapshot_every ---------------------------------------


@pytest.mark.parametrize("stage", ["PrefetchIterator", "ParallelMapIterator"])
@pytest.mark.parametrize("replay", [10**18, 2**64, -1, 8])
def test_a_replay_beyond_snapshot_every_is_refused_at_once(stage: str, replay: int) -> None:
    def build() -> Any:
        if stage == "PrefetchIterator":
            return it.PrefetchIterator(native(50), 4, mode="thread", snapshot_every=7)
        return it.ParallelMapIterator(native(50), same, 2, 2, mode="thread", snapshot_every=7)

    with build() as pipeline:
        state = {**pipeline.getstate(), "replay": replay}
        with pytest.raises(StateMismatchError, match=rf"{stage}.*'replay'.*snapshot_every=7"):
            within(HANG, lambda: pipeline.setstate(state))  # replaying 10**18 items: never


def _stages(every: int, mode: str) -> list[Callable[[], Any]]:
    return [
        lambda: it.PrefetchIterator(native(120), 5, mode=mode, snapshot_every=every),
        lambda: it.ParallelMapIterator(native(120), same, 2, 3, mode=mode, snapshot_every=every),
    ]


@settings(max_examples=examples(0.25))
@given(every=st.integers(1, 12), cuts=st.lists(st.integers(0, 30), min_size=1, max_size=5))
def test_states_never_replay_more_than_snapshot_every_across_restores(
    every: int, cuts: list[int]
) -> None:
    for build in _stages(every, "thread"):
        expected: list[Any] = list(range(120))
        position = 0
        state = None
        for cut in cuts:
            with build() as pipeline:
                pipeline.setstate(state)
                for _ in range(cut):
                    if position == len(expected):
                        break
                    assert pipeline.getstate()["replay"] <= every
                    assert next(pipeline) == expected[position]
                    position += 1
                state = pipeline.getstate()
                assert state["replay"] <= every


# -- ParallelMapIterator in threads ------------------------------------------------------------


def decompress(block: bytes) -> int:
    return len(zlib.decompress(block))


def test_thread_mode_maps_in_worker_threads_in_order() -> None:
    blocks = [zlib.compress(bytes([i % 251]) * (10_000 + i)) for i in range(60)]
    names: set[str] = set()

    def named(block: bytes) -> int:
        names.add(threading.current_thread().name)
        return decompress(block)

    source = it.NativeCheckpointableIterator(blocks)
    with it.ParallelMapIterator(source, named, 3, 2, mode="thread") as pipeline:
        assert list(pipeline) == [10_000 + i for i in range(60)]
    assert names
    assert all(name.startswith("infinibatch_like.ParallelMapIterator") for name in names)
    assert not [t for t in threading.enumerate() if t.name.startswith("infinibatch_like")]


def test_an_unknown_mode_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"ParallelMapIterator: mode .* got 'fiber'"):
        it.ParallelMapIterator(native(3), same, 1, 1, mode="fiber")


# -- starting the workers early ----------------------------------------------------------------


def touch(directory: str, x: int) -> int:
    Path(directory, str(x)).touch()
    return x


@pytest.mark.parametrize("method", METHODS)
def test_start_replays_in_the_worker_before_the_first_next(method: str, tmp_path: Path) -> None:
    def build(directory: Path) -> it.PrefetchIterator:
        source = it.MapIterator(native(100), functools.partial(touch, str(directory)))
        return it.PrefetchIterator(source, 4, start_method=method, snapshot_every=10)

    with build(tmp_path / "first") as pipeline:
        (tmp_path / "first").mkdir()
        for _ in range(27):
            next(pipeline)
        state = pipeline.getstate()  # snapshot at 20, replay 7
    (tmp_path / "second").mkdir()
    with build(tmp_path / "second") as resumed:
        resumed.setstate(state)
        resumed.start()
        # the worker reads the snapshot's items 20..26 again, then runs ahead
        assert wait_until((tmp_path / "second" / "28").exists)
        assert sorted(int(p.name) for p in (tmp_path / "second").iterdir())[0] == 20
        assert next(resumed) == 27
    assert not children()


def test_start_of_a_parallel_map_starts_its_pool_and_fills_it(tmp_path: Path) -> None:
    transform = functools.partial(touch, str(tmp_path))
    with it.ParallelMapIterator(native(100), transform, 2, 3, snapshot_every=10) as pipeline:
        pipeline.setstate({**pipeline.getstate(), "replay": 5})
        pipeline.start()
        assert len(children()) == 2
        assert wait_until((tmp_path / "6").exists)
        assert not (tmp_path / "4").exists()  # replayed items are skipped, not transformed
        assert next(pipeline) == 5
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.start()
    assert not children()


def test_start_background_starts_every_background_stage_of_a_pipeline() -> None:
    from infinibatch_like import start_background

    inner = it.PrefetchIterator(native(30), 4, mode="thread")
    pipeline = it.MapIterator(it.ParallelMapIterator(inner, same, 2, 2), same)
    with pipeline:
        start_background(pipeline)
        assert len(children()) == 2
        assert [t for t in threading.enumerate() if t.name.endswith("PrefetchIterator.worker")]
        assert list(pipeline) == list(range(30))
    assert not children()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_start_after_the_end_or_an_error_starts_nothing(mode: str) -> None:
    ended = it.PrefetchIterator(native(5), 2, mode=mode)
    failed = it.ParallelMapIterator(native(9), functools.partial(fail_at, 3), 2, 1, mode=mode)
    with ended, failed:
        assert list(ended) == list(range(5))
        with pytest.raises(ValueError, match="bad item 3"):
            drain(failed, [])
        for stage in (ended, failed):
            stage.start()
            assert not children()
            assert not [t for t in threading.enumerate() if t.name.startswith("infinibatch_like")]


def test_where_processes_are_refused_workers_run_in_threads_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from multiprocessing.process import BaseProcess

    from infinibatch_like.background import lifecycle

    def refuse(process: BaseProcess) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(BaseProcess, "start", refuse)
    monkeypatch.setattr(lifecycle, "_FALLBACK_WARNED", [])
    pipeline = it.ParallelMapIterator(it.PrefetchIterator(native(40), 4), same, 2, 3)
    with caplog.at_level("WARNING", logger="infinibatch_like"), pipeline:
        assert list(pipeline) == list(range(40))
        pipeline.setstate(None)
        assert next(pipeline) == 0
    warnings = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "threads instead" in warnings[0]
    assert not children()


_TORCH_AFTER_THE_CONSUMER_USED_IT = """
import sys
sys.path.insert(0, {repo!r})
import torch
import infinibatch_like.iterators as it

assert torch.get_num_threads() > 1, torch.get_num_threads()
torch.full((1 << 22,), 1.0).sum()  # the consumer's OpenMP threads have run


def tensor(i):
    return torch.full((1 << 18,), float(i))  # a parallel fill in the forked worker


source = it.MapIterator(it.NativeCheckpointableIterator(list(range(8))), tensor)
with it.{stage} as pipeline:
    assert [float(t[0]) for t in pipeline] == [float(i) for i in range(8)]
print("ok")
"""


@pytest.mark.parametrize(
    "stage",
    [
        'PrefetchIterator(source, 4, mode="process", start_method="fork")',
        'ParallelMapIterator(it.NativeCheckpointableIterator(list(range(8))), tensor, 2, 4, '
        'start_method="fork")',
    ],
    ids=["prefetch", "parallel_map"],
)
def test_forked_workers_run_torch_after_the_consumer_ran_parallel_torch_ops(stage: str) -> None:
    # GNU OpenMP is not fork-safe: a forked child whose parent has run a parallel region
    # waits forever at its first one, unless it runs them on one thread
    code = _TORCH_AFTER_THE_CONSUMER_USED_IT.format(repo=REPO, stage=stage)
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a forked worker hung in its first parallel torch operation")
    assert result.stdout.strip() == "ok", result.stderr
