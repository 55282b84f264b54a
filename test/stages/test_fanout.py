"""FanOut: one upstream read once by several consumers (threads, or processes attached by
a Unix socket), replicate and split, bounded lag, one exact checkpoint for all."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _leaks import fd_targets, open_fds
from _profiles import examples
from _waiting import HANG, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like import (
    FanOut,
    StateMismatchError,
    WorkerError,
    attach,
    empty_shared_pool,
    shared_empty,
)
from infinibatch_like.background import segments, shm_arrays, shm_broadcast
from infinibatch_like.iterators import MapIterator, NativeCheckpointableIterator
from infinibatch_like.testing import assert_checkpointable, check_resume

METHODS = ["fork", "forkserver", "spawn"]


class Counting:
    """A transform that counts its calls (shared by the threads of this process)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: int) -> int:
        self.calls += 1
        return x * 10


def times_ten(x: int) -> int:
    return x * 10


def upstream(n: int = 60, transform: Callable[[int], int] = times_ten) -> MapIterator:
    return MapIterator(NativeCheckpointableIterator(list(range(n))), transform)


def read_all(consumers: list[Any]) -> list[list[Any]]:
    """Each consumer read to its end by a thread of its own."""
    out: list[list[Any]] = [[] for _ in consumers]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            out[index].extend(consumers[index])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(consumers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return out


# -- in one process: threads --------------------------------------------------------------


def test_replicate_gives_every_consumer_every_item_and_reads_the_upstream_once() -> None:
    transform = Counting()
    fan = FanOut(upstream(60, transform), 4, max_lag=3)
    out = read_all([fan.consumer(i) for i in range(4)])
    assert out == [[x * 10 for x in range(60)]] * 4
    assert transform.calls == 60
    assert fan.pulled == 60


def test_split_gives_each_item_to_exactly_one_consumer_round_robin() -> None:
    transform = Counting()
    fan = FanOut(upstream(50, transform), 3, mode="split", max_lag=2)
    out = read_all([fan.consumer(i) for i in range(3)])
    assert out == [[x * 10 for x in range(i, 50, 3)] for i in range(3)]
    assert transform.calls == 50


def test_a_fast_consumer_waits_at_max_lag_ahead_of_the_slowest() -> None:
    fan = FanOut(upstream(40), 2, max_lag=5)
    fast, slow = fan.consumer(0), fan.consumer(1)
    taken: list[int] = []
    reader = threading.Thread(target=lambda: taken.extend(fast), daemon=True)
    reader.start()
    assert wait_until(lambda: len(taken) >= 5)
    time.sleep(0.1)  # room to run further ahead, if it did not wait
    assert len(taken) == 5  # waits there
    assert len(fan._hub.buffer) <= 6
    assert next(slow) == 0
    assert wait_until(lambda: len(taken) >= 6)
    time.sleep(0.1)
    assert len(taken) == 6  # one more, no further
    slow.close()  # a closed consumer holds no one back
    reader.join(10)
    assert taken == [x * 10 for x in range(40)]


def test_waiting_for_a_consumer_read_by_the_same_thread_raises_at_once() -> None:
    fan = FanOut(upstream(), 2, max_lag=2)
    first, second = fan.consumer(0), fan.consumer(1)
    next(second)
    next(first), next(first), next(first)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ahead of consumer 1, which was last read by this same"):
        next(first)  # in this thread: a wait here could only end with the timeout
    assert time.monotonic() - started < HANG  # at once, not after the timeout (300 s)


def test_a_consumer_that_never_moves_raises_after_timeout_naming_it() -> None:
    fan = FanOut(upstream(), 3, max_lag=2, timeout=0.5)
    first = fan.consumer(0)
    fan.consumer(1).close()
    fan.consumer(2)
    next(first), next(first)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ahead of consumer 2, which has taken no item for"):
        next(first)
    assert 0.4 < time.monotonic() - started < 5


def test_closing_every_consumer_closes_the_upstream() -> None:
    source = upstream()
    fan = FanOut(source, 2)
    consumers = [fan.consumer(0), fan.consumer(1)]
    consumers[0].close()
    assert not source._closed
    consumers[1].close()
    assert source._closed
    with pytest.raises(RuntimeError, match="closed"):
        next(consumers[1])


def test_an_upstream_error_reaches_the_consumers_at_its_item() -> None:
    def fail_at_seven(x: int) -> int:
        if x == 7:
            raise ValueError("bad item 7")
        return x

    fan = FanOut(upstream(20, fail_at_seven), 2, mode="split", max_lag=10)
    even, odd = fan.consumer(0), fan.consumer(1)
    assert [next(odd) for _ in range(3)] == [1, 3, 5]
    with pytest.raises(ValueError, match="bad item 7"):
        next(odd)
    assert [next(even) for _ in range(4)] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="bad item 7"):
        next(even)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="FanOut: mode must be one of"):
        FanOut(upstream(), 2, mode="broadcast")
    with pytest.raises(ValueError, match="FanOut: consumers must be >= 1"):
        FanOut(upstream(), 0)
    with pytest.raises(ValueError, match="FanOut: max_lag must be >= 1"):
        FanOut(upstream(), 2, max_lag=0)
    with pytest.raises(ValueError, match="FanOut: source must be a CheckpointableIterator"):
        FanOut([1, 2], 2)  # type: ignore[arg-type]
    fan = FanOut(upstream(), 2)
    fan.consumer(0)
    with pytest.raises(ValueError, match="FanOut: consumer 0 is already taken"):
        fan.consumer(0)
    with pytest.raises(ValueError, match="consumer index must be < consumers=2, got 2"):
        fan.consumer(2)


# -- one checkpoint ------------------------------------------------------------------------


def test_one_state_from_any_consumer_or_the_owner_restores_everyone_exactly() -> None:
    fan = FanOut(upstream(80), 3, mode="split", max_lag=4, snapshot_every=5)
    consumers = [fan.consumer(i) for i in range(3)]
    for _ in range(6):
        for consumer in consumers:
            next(consumer)
    next(consumers[0]), next(consumers[0]), next(consumers[2])
    state = fan.getstate()
    assert all(consumer.getstate() == state for consumer in consumers)
    assert state["taken"] == [8, 6, 7]
    assert state["source_index"] <= 6 * 3 + 1  # at or before the slowest consumer
    rest = read_all(consumers)

    restored = FanOut(upstream(80), 3, mode="split", max_lag=4, snapshot_every=5)
    restored.setstate(json.loads(json.dumps(state)))
    assert read_all([restored.consumer(i) for i in range(3)]) == rest
    assert restored.pulled <= 80 - state["source_index"]


def test_a_consumer_restored_alone_continues_exactly_while_the_others_go_on() -> None:
    fan = FanOut(upstream(100), 2, max_lag=6, snapshot_every=4)
    first, second = fan.consumer(0), fan.consumer(1)
    for _ in range(10):
        next(first), next(second)
    state = second.getstate()
    for _ in range(5):
        next(first), next(second)
    second.setstate(state)  # its process restarted from the last checkpoint
    out = read_all([first, second])
    assert out[0] == [x * 10 for x in range(15, 100)]
    assert out[1] == [x * 10 for x in range(10, 100)]


def test_states_of_another_mode_or_count_are_refused_naming_the_argument() -> None:
    fan = FanOut(upstream(), 2, mode="split")
    next(fan.consumer(0))
    state = fan.getstate()
    with pytest.raises(StateMismatchError, match="taken with mode='split'"):
        FanOut(upstream(), 2).setstate(state)
    with pytest.raises(StateMismatchError, match="taken with consumers=2"):
        FanOut(upstream(), 3, mode="split").consumer(1).setstate(state)


def test_a_state_replaying_more_than_any_state_holds_is_refused() -> None:
    fan = FanOut(upstream(), 2, snapshot_every=5)
    state = fan.getstate()
    state["taken"] = [40, 40]  # 5 + (16 + 1) * 2 = 39 at most
    with pytest.raises(StateMismatchError, match=r"more than snapshot_every \+ \(max_lag"):
        FanOut(upstream(), 2, snapshot_every=5).setstate(state)
    state["taken"] = [1, 2, 3]
    with pytest.raises(
        StateMismatchError,
        match=r"state field 'taken' holds 3 items, expected 2 \(one per consumer\)",
    ):
        FanOut(upstream(), 2, snapshot_every=5).setstate(state)
    state["taken"] = [1, -1]
    with pytest.raises(StateMismatchError, match=r"state field 'taken\[1\]' must be >= 0, got -1"):
        FanOut(upstream(), 2, snapshot_every=5).setstate(state)
    state["taken"], state["closed"] = [1, 1], [False, 0]
    with pytest.raises(
        StateMismatchError, match=r"state field 'closed\[1\]' has type int, expected bool"
    ):
        FanOut(upstream(), 2, snapshot_every=5).setstate(state)


def _replicate_consumer() -> Any:
    fan = FanOut(upstream(45), 2, max_lag=3, snapshot_every=4)
    fan.consumer(1).close()
    return fan.consumer(0)


def _split_consumer() -> Any:
    fan = FanOut(upstream(70), 3, mode="split", snapshot_every=5)
    fan.consumer(0).close()
    fan.consumer(2).close()
    return fan.consumer(1)


@pytest.mark.parametrize("factory", [_replicate_consumer, _split_consumer])
def test_each_consumer_passes_the_contract(factory: Callable[[], Any]) -> None:
    assert_checkpointable(factory, max_items=40, check_pickle=False)
    check_resume(factory, max_items=40)


def serve_fresh_fan_outs(requests: Any) -> None:
    """An owner process: for each path received, a fresh fan-out served there (consumer 1
    closed, consumer 0 left to attach)."""
    fans = []
    while (path := requests.recv()) is not None:
        fan = FanOut(upstream(45), 2, max_lag=3, snapshot_every=4)
        fan.consumer(1).close()
        fans.append(fan)
        requests.send(fan.serve(path))


def test_a_remote_consumer_passes_the_contract(tmp_path: Path) -> None:
    requests, owner_end = multiprocessing.Pipe()
    owner = multiprocessing.get_context("fork").Process(
        target=serve_fresh_fan_outs, args=(owner_end,)
    )
    owner.start()
    sockets = iter(range(10**6))

    def factory() -> Any:
        requests.send(str(tmp_path / f"{next(sockets)}.sock"))
        return attach(requests.recv(), 0, timeout=5)

    try:
        assert_checkpointable(factory, max_items=30, check_pickle=False, restore_points=[0, 7])
        check_resume(factory, max_items=30, restore_points=[0, 11, 30])
    finally:
        requests.send(None)
        owner.join(10)


# -- hypothesis: the split assignment and the lag bound under any interleaving ---------------


@settings(max_examples=examples(0.4))
@given(
    consumers=st.integers(1, 4),
    split=st.booleans(),
    max_lag=st.integers(1, 5),
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    restore_at=st.integers(0, 120),
)
def test_any_interleaving_keeps_the_assignment_the_lag_bound_and_exact_restores(
    consumers: int, split: bool, max_lag: int, steps: list[int], restore_at: int
) -> None:
    mode = "split" if split else "replicate"
    n = 50

    def build() -> FanOut[int]:
        return FanOut(upstream(n), consumers, mode=mode, max_lag=max_lag, snapshot_every=3)

    fan = build()
    readers = [fan.consumer(i) for i in range(consumers)]
    got: list[list[int]] = [[] for _ in range(consumers)]
    saved: tuple[Any, list[int]] | None = None
    for step, choice in enumerate(steps):
        if step == restore_at:
            saved = (fan.getstate(), [len(g) for g in got])
        taken = fan._hub.taken
        movable = [
            i
            for i in range(consumers)
            if taken[i] - min(taken) < max_lag and not fan._hub._ended(i)
        ]
        if not movable:
            break
        index = movable[choice % len(movable)]
        with contextlib.suppress(StopIteration):
            got[index].append(next(readers[index]))
        held = len(fan._hub.buffer)
        assert held <= (max_lag + 1) * consumers
        assert max(taken) - min(taken) <= max_lag
    for i in range(consumers):
        expected = range(i, n, consumers) if split else range(n)
        assert got[i] == [x * 10 for x in expected][: len(got[i])]
    if saved is not None:
        state, lengths = saved
        again = build()
        again.setstate(json.loads(json.dumps(state)))
        continued = read_all([again.consumer(i) for i in range(consumers)])
        for i in range(consumers):
            expected = range(i, n, consumers) if split else range(n)
            assert continued[i] == [x * 10 for x in expected][lengths[i] :]


# -- processes of the host -----------------------------------------------------------------


def consume(address: str, index: int, out: str, every: int, kill_at: int) -> None:
    """A consumer process: resumes from its checkpoint file if there is one, writes each
    item to `out`, checkpoints every `every` items, SIGKILLs itself after `kill_at`."""
    checkpoint = Path(out + ".ckpt")
    consumer = attach(address, index, timeout=20)
    lines = 0
    if checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        consumer.setstate(saved["state"])
        lines = saved["lines"]
    with open(out, "a+") as file:
        file.truncate(sum(len(line) for line in Path(out).read_text().splitlines(True)[:lines]))
        for item in consumer:
            file.write(f"{item}\n")
            file.flush()
            lines += 1
            if lines % every == 0:
                tmp = checkpoint.with_suffix(".tmp")
                tmp.write_text(json.dumps({"state": consumer.getstate(), "lines": lines}))
                os.replace(tmp, checkpoint)
            if lines == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    consumer.close()


def _items(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().splitlines()]


def _start_singletons(method: str) -> None:
    """Start multiprocessing's own helper processes (they live as long as this one), so
    that counting descriptors shows what the fan-out leaves behind."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    if method == "forkserver":
        forkserver.ensure_running()


def _start(method: str, *args: Any) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context(method).Process(target=consume, args=args)
    process.start()
    return process


@pytest.mark.parametrize("method", METHODS)
def test_split_over_two_processes_gives_the_union_exactly_once(
    method: str, tmp_path: Path
) -> None:
    transform = Counting()
    _start_singletons(method)
    gc.collect()  # what earlier tests left to the collector goes now, not mid-test
    fds = open_fds()
    with FanOut(upstream(90, transform), 2, mode="split", max_lag=4) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        outs = [tmp_path / f"out{i}" for i in range(2)]
        processes = [_start(method, address, i, str(outs[i]), 1000, -1) for i in range(2)]
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
            process.close()
    got = [_items(out) for out in outs]
    assert sorted(got[0] + got[1]) == [x * 10 for x in range(90)]
    assert got[0] == [x * 10 for x in range(0, 90, 2)]
    assert transform.calls == 90  # read once, in the owner
    assert not (tmp_path / "fan.sock").exists()
    assert open_fds() == fds
    assert not [t for t in threading.enumerate() if t.name.startswith("infinibatch_like.FanOut")]


@pytest.mark.parametrize("method", METHODS)
def test_a_consumer_process_killed_and_restarted_continues_exactly(
    method: str, tmp_path: Path
) -> None:
    with FanOut(upstream(120), 2, max_lag=8, snapshot_every=10, timeout=60) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        steady, victim = tmp_path / "steady", tmp_path / "victim"
        first = _start(method, address, 0, str(steady), 1000, -1)
        killed = _start(method, address, 1, str(victim), 7, 31)
        killed.join(60)
        assert killed.exitcode == -signal.SIGKILL
        time.sleep(0.5)  # the other goes on up to max_lag ahead, then waits
        assert len(_items(steady)) <= 31 + 8
        restarted = _start(method, address, 1, str(victim), 7, -1)
        for process in (first, restarted):
            process.join(60)
            assert process.exitcode == 0
    reference = [x * 10 for x in range(120)]
    assert _items(steady) == reference
    assert _items(victim) == reference


def test_an_owner_restored_from_one_state_serves_each_process_its_continuation(
    tmp_path: Path,
) -> None:
    fan = FanOut(upstream(60), 2, mode="split", max_lag=4, snapshot_every=5)
    even, odd = fan.consumer(0), fan.consumer(1)
    for _ in range(7):
        next(even), next(odd)
    next(even)
    state = fan.getstate()
    rest = read_all([even, odd])
    with FanOut(upstream(60), 2, mode="split", max_lag=4, snapshot_every=5) as restored:
        restored.setstate(json.loads(json.dumps(state)))
        address = restored.serve(str(tmp_path / "fan.sock"))
        outs = [tmp_path / f"out{i}" for i in range(2)]
        processes = [_start("spawn", address, i, str(outs[i]), 1000, -1) for i in range(2)]
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
    assert [_items(out) for out in outs] == rest


def test_a_consumer_sees_its_owner_die_within_a_second(tmp_path: Path) -> None:
    address = str(tmp_path / "fan.sock")
    context = multiprocessing.get_context("spawn")
    owner = context.Process(target=serve_for_a_while, args=(address,))
    owner.start()
    try:
        consumer = attach(address, 0, timeout=30)
        assert next(consumer) == 0
        owner.kill()
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"the owner .* closed or died while consumer 0"):
            list(consumer)
        assert time.monotonic() - started < 2
        consumer.close()
    finally:
        owner.kill()
        owner.join()


def serve_for_a_while(address: str) -> None:
    fan = FanOut(upstream(10**6, times_ten), 2, max_lag=2)
    fan.serve(address)
    fan.consumer(1)  # never read: consumer 0 waits
    time.sleep(60)


def test_serving_where_a_killed_owner_left_its_socket_replaces_it(tmp_path: Path) -> None:
    address = str(tmp_path / "fan.sock")
    owner = multiprocessing.get_context("fork").Process(target=serve_for_a_while, args=(address,))
    owner.start()
    try:
        assert next(attach(address, 0, timeout=30)) == 0  # it serves
    finally:
        owner.kill()
        owner.join()
    assert os.path.exists(address)  # what SIGKILL leaves
    with FanOut(upstream(5), 1) as fan:
        fan.serve(address)
        with attach(address, 0, timeout=5) as consumer:
            assert list(consumer) == [0, 10, 20, 30, 40]


def test_serving_where_an_owner_serves_or_a_file_is_is_refused(tmp_path: Path) -> None:
    address = str(tmp_path / "fan.sock")
    with FanOut(upstream(5), 1) as live, FanOut(upstream(5), 1) as second:
        live.serve(address)
        with pytest.raises(ValueError, match=r"another owner serves at .*fan\.sock"):
            second.serve(address)
        with attach(address, 0, timeout=5) as consumer:  # the first still serves
            assert next(consumer) == 0
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    with FanOut(upstream(5), 1) as fan, pytest.raises(ValueError, match="not a socket"):
        fan.serve(str(plain))
    assert plain.read_text() == "keep me"


def test_a_prefetching_remote_consumer_yields_the_stream_and_checkpoints_exactly(
    tmp_path: Path,
) -> None:
    with FanOut(upstream(100), 2, max_lag=20, snapshot_every=6) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        local = fan.consumer(0)
        remote = attach(address, 1, timeout=5, prefetch=8)
        got = [next(remote) for _ in range(11)]  # items 11.. are held, unused
        state = remote.getstate()
        assert state["taken"][1] == 11
        rest = [next(remote) for _ in range(9)]
        assert [next(local) for _ in range(20)] == got + rest
        remote.setstate(state)  # back to item 11, as a restarted process would be
        assert [next(remote) for _ in range(9)] == rest
        remote.close()
    assert got + rest == [x * 10 for x in range(20)]
    again = FanOut(upstream(100), 2, max_lag=20, snapshot_every=6)
    again.setstate(state)
    resumed = again.consumer(1)
    assert [next(resumed) for _ in range(9)] == rest


def test_attach_without_an_owner_times_out_naming_the_address(tmp_path: Path) -> None:
    address = str(tmp_path / "nobody.sock")
    with pytest.raises(TimeoutError, match=r"no fan-out serves at .*nobody\.sock"):
        attach(address, 0, timeout=0.3)


def test_a_refused_attach_closes_its_connection_at_once(tmp_path: Path) -> None:
    gc.collect()  # what earlier tests left to the collector goes now, not mid-test
    fds = fd_targets()
    fan = FanOut(upstream(30), 2)
    address = fan.serve(str(tmp_path / "fan.sock"))
    local = fan.consumer(0)
    with pytest.raises(ValueError, match="consumer 0 is already taken") as refused:
        attach(address, 0, timeout=5)
    assert next(local) == 0
    fan.close()  # the owner's side of every connection is closed
    # the error, its traceback and the frames in it are still alive: no collector has run
    assert refused.value.__traceback__ is not None
    assert fd_targets() == fds


def send_fd_targets(out: Any) -> None:
    out.send(sorted(fd_targets().values()))


def test_a_child_forked_while_the_owner_starts_serving_does_not_keep_its_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipeline's worker processes may be forked by another thread while `serve` sets
    # up (here: as the server makes its shared memory); a child that kept the listening
    # socket would answer at the address after the owner died, and a restarted owner
    # would refuse to serve there ("another owner serves").
    children: list[tuple[Any, Any]] = []
    setting_up = shm_broadcast.Broadcast.__init__

    def fork_meanwhile(broadcast: shm_broadcast.Broadcast) -> None:
        reader, writer = multiprocessing.Pipe(duplex=False)
        child = multiprocessing.get_context("fork").Process(
            target=send_fd_targets, args=(writer,)
        )
        child.start()
        children.append((child, reader))
        setting_up(broadcast)

    monkeypatch.setattr(shm_broadcast.Broadcast, "__init__", fork_meanwhile)
    before = set(fd_targets().values())
    with FanOut(upstream(3), 1) as fan:
        fan.serve(str(tmp_path / "fan.sock"))
        sockets = {t for t in fd_targets().values() if t.startswith("socket:")} - before
        assert children
        for child, reader in children:
            inherited = set(reader.recv())
            child.join(30)
            assert not inherited & sockets, "the child kept the owner's listening socket"


def test_attaching_a_taken_consumer_is_refused_and_the_owner_closes_cleanly(
    tmp_path: Path,
) -> None:
    gc.collect()  # what earlier tests left to the collector goes now, not mid-test
    fds = fd_targets()
    fan = FanOut(upstream(30), 2)
    address = fan.serve(str(tmp_path / "fan.sock"))
    local = fan.consumer(0)
    with pytest.raises(ValueError, match="consumer 0 is already taken"):
        attach(address, 0, timeout=5)
    remote = attach(address, 1, timeout=5)
    assert next(remote) == 0
    assert next(local) == 0
    assert remote.getstate() == fan.getstate()
    fan.close()
    with pytest.raises((WorkerError, RuntimeError)):
        next(remote)
    remote.close()
    assert fd_targets() == fds
    assert not Path(address).exists()


# -- shared memory: large arrays and tensors reach consumer processes as one copy ----------

ARRAY_ITEMS = 12


def array_item(i: int) -> dict[str, Any]:
    """An item whose array and tensor are large enough for shared memory."""
    import numpy as np
    import torch

    return {
        "i": i,
        "array": np.full(1 << 18, i, dtype=np.int32),
        "tensor": torch.full((40_000,), float(i), dtype=torch.float64).reshape(200, 200).t(),
    }


def shared_array_item(i: int) -> dict[str, Any]:
    """`array_item(i)`, its array and tensor made in shared memory (`shared_empty`)."""
    import torch

    array = shared_empty(1 << 18, "int32")
    array[:] = i
    values = shared_empty(40_000, "float64")
    values[:] = float(i)
    return {"i": i, "array": array, "tensor": torch.from_numpy(values).reshape(200, 200).t()}


MADE = {"by numpy": array_item, "in shared memory": shared_array_item}
"""How an item's arrays are made: by numpy (a fan-out copies them into its segments once)
or by `shared_empty` (sent where they lie)."""


def made_here() -> str:
    """The prefix of the segments of this process's `shared_empty` arrays."""
    return shm_arrays.names_prefix(os.getpid(), segments.tracker_id())


def left_after(items: list[Any]) -> list[str]:
    """This process's segments once `items` and every unused segment are gone."""
    items.clear()
    gc.collect()
    empty_shared_pool()
    return owner_segments()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def expected_record(i: int) -> list[Any]:
    item = array_item(i)
    tensor = item["tensor"].contiguous().numpy().tobytes()
    return [i, _digest(item["array"].tobytes()), _digest(tensor), list(item["tensor"].stride())]


def _segment_at(address: int) -> str | None:
    """The /dev/shm segment whose mapping holds `address` in this process, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/ibl_" in line:
                start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
                if start <= address < end:
                    return line.split("/dev/shm/")[1].split()[0]
    return None


def single_threaded_torch() -> None:
    """What a consumer process forked after torch ran its thread pool does first (as
    docs/howto/several-consumers.md says): a forked OpenMP pool may hang."""
    import torch

    torch.set_num_threads(1)


def consume_arrays(address: str, index: int, out: str) -> None:
    """A consumer process: records each item's digests and the segments its array and
    tensor lie in, then writes into them (its copies are its own)."""
    single_threaded_torch()
    records = []
    with attach(address, index, timeout=20, prefetch=4) as consumer:
        for item in consumer:
            array, tensor = item["array"], item["tensor"]
            tensor_bytes = tensor.contiguous().numpy().tobytes()
            records.append(
                [
                    [
                        item["i"],
                        _digest(array.tobytes()),
                        _digest(tensor_bytes),
                        list(tensor.stride()),
                    ],
                    _segment_at(array.__array_interface__["data"][0]),
                    _segment_at(tensor.data_ptr()),
                ]
            )
            array[:] = -1
            tensor[:] = -1.0
    Path(out).write_text(json.dumps(records))


def owner_segments() -> list[str]:
    prefix = f"ibl_{os.getpid()}_"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


@pytest.mark.parametrize("made", MADE)
@pytest.mark.parametrize("method", METHODS)
def test_large_arrays_reach_every_consumer_process_as_one_shared_copy(
    method: str, made: str, tmp_path: Path
) -> None:
    owned: list[dict[str, Any]] = []

    def make(i: int) -> dict[str, Any]:
        owned.append(MADE[made](i))
        return owned[-1]

    with FanOut(MapIterator(native_range(ARRAY_ITEMS), make), 2, max_lag=3) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        outs = [tmp_path / f"out{i}" for i in range(2)]
        context = multiprocessing.get_context(method)
        processes = [
            context.Process(target=consume_arrays, args=(address, i, str(outs[i])))
            for i in range(2)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
    got = [json.loads(out.read_text()) for out in outs]
    expected = [expected_record(i) for i in range(ARRAY_ITEMS)]
    for records in got:  # exact, whatever the other consumer wrote into its copies
        assert [record[0] for record in records] == expected
    segments = [[record[1:] for record in records] for records in got]
    assert all(name is not None for names in segments[0] for name in names)
    assert segments[0] == segments[1]  # the same segments: one copy for both consumers
    assert all(array != tensor for array, tensor in segments[0])
    # made in shared memory: the consumers mapped the owner's own arrays, not copies
    assert all(name.startswith(made_here()) == (made == "in shared memory")
               for names in segments[0] for name in names)
    # what the consumers wrote into their views stayed theirs
    assert [expected_record(item["i"]) for item in owned] == expected
    assert not left_after(owned)


def keep_arrays(address: str, index: int, out: str) -> None:
    """A consumer process that keeps every item it reads, then records their digests: a
    segment it still maps is never written again by the owner."""
    single_threaded_torch()
    with attach(address, index, timeout=20, prefetch=4) as consumer:
        kept = list(consumer)
    records = [
        [
            item["i"],
            _digest(item["array"].tobytes()),
            _digest(item["tensor"].contiguous().numpy().tobytes()),
            list(item["tensor"].stride()),
        ]
        for item in kept
    ]
    Path(out).write_text(json.dumps(records))


@pytest.mark.parametrize("made", MADE)
def test_a_segment_is_not_reused_while_a_consumer_process_keeps_its_array(
    made: str, tmp_path: Path
) -> None:
    with FanOut(MapIterator(native_range(ARRAY_ITEMS), MADE[made]), 2, max_lag=3) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        outs = [tmp_path / "kept", tmp_path / "dropped"]
        keeper = _start_target(keep_arrays, address, 0, str(outs[0]))
        dropper = _start_target(consume_arrays, address, 1, str(outs[1]))
        for process in (keeper, dropper):
            process.join(60)
            assert process.exitcode == 0
    expected = [expected_record(i) for i in range(ARRAY_ITEMS)]
    assert json.loads(outs[0].read_text()) == expected
    assert [record[0] for record in json.loads(outs[1].read_text())] == expected
    assert not left_after([])


def small_array(i: int) -> Any:
    import numpy as np

    return np.full(1 << 14, i, dtype=np.int32)  # 64 KiB: through shared memory


def record_segments(address: str, index: int, out: str) -> None:
    """A consumer process that drops each item once it has recorded its first value and
    the segment it lay in."""
    records = []
    with attach(address, index, timeout=20, prefetch=4) as consumer:
        for array in consumer:
            records.append([int(array[0]), _segment_at(array.__array_interface__["data"][0])])
    Path(out).write_text(json.dumps(records))


def test_segments_are_recycled_once_every_consumer_process_dropped_their_arrays(
    tmp_path: Path,
) -> None:
    items, max_lag, prefetch = 60, 3, 4
    with FanOut(MapIterator(native_range(items), small_array), 2, max_lag=max_lag) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        got = recorded(record_segments, address, [tmp_path / f"out{i}" for i in range(2)])
    assert [value for value, _ in got[0]] == [value for value, _ in got[1]] == list(range(items))
    assert [name for _, name in got[0]] == [name for _, name in got[1]]
    # at once in use: the lag window, and what each consumer holds or is being sent
    assert len({name for _, name in got[0]}) <= max_lag + 2 * prefetch + 2
    assert not owner_segments()


def test_a_full_dev_shm_gives_consumer_processes_their_items_through_their_sockets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # no ring, no segment for arrays
    with FanOut(MapIterator(native_range(20), small_array), 2, max_lag=3) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        got = recorded(record_segments, address, [tmp_path / f"out{i}" for i in range(2)])
        assert not owner_segments()
    assert got == [[[i, None] for i in range(20)]] * 2


def serve_arrays_for_a_while(address: str, made: str) -> None:
    fan = FanOut(MapIterator(native_range(10**6), MADE[made]), 2, max_lag=4)
    fan.serve(address)
    fan.consumer(1)  # never read: consumer 0 waits, its items kept for consumer 1
    time.sleep(60)


@pytest.mark.parametrize("made", MADE)
def test_segments_of_an_owner_killed_with_sigkill_are_removed_by_its_consumers(
    made: str, tmp_path: Path
) -> None:
    address = str(tmp_path / "fan.sock")
    owner = multiprocessing.get_context("spawn").Process(
        target=serve_arrays_for_a_while, args=(address, made)
    )
    owner.start()
    try:
        consumer = attach(address, 0, timeout=30, prefetch=2)
        kept = next(consumer)["array"]
        prefix = f"ibl_{owner.pid}_"
        made_there = f"{prefix}t{segments.tracker_id()}_a"  # the owner's shared_empty arrays
        left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
        assert any(name.startswith(made_there) for name in left) == (made == "in shared memory")
        owner.kill()
        owner.join()  # not left a zombie, which would look alive
        with pytest.raises(WorkerError, match="closed or died"):
            list(consumer)
        consumer.close()
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
        assert int(kept[0]) == 0  # what it mapped stays valid
    finally:
        owner.kill()
        owner.join()


def test_no_segment_outlives_a_fan_out_whose_consumer_process_was_killed(
    tmp_path: Path,
) -> None:
    with FanOut(MapIterator(native_range(40), array_item), 2, max_lag=4, timeout=60) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        killed = _start_target(kill_after_arrays, address, 1, 5)
        local = fan.consumer(0)
        got = [next(local)["i"] for _ in range(5)]
        killed.join(60)
        assert killed.exitcode == -signal.SIGKILL
        assert owner_segments()  # items kept for the killed consumer, maybe sent to it
        fan.close_consumer(1)
        got += [item["i"] for item in local]
    assert got == list(range(40))
    assert not owner_segments()


def kill_after_arrays(address: str, index: int, count: int) -> None:
    consumer = attach(address, index, timeout=20, prefetch=3)
    for _ in range(count):
        next(consumer)
    os.kill(os.getpid(), signal.SIGKILL)


def small_array_item(i: int) -> dict[str, Any]:
    """An item whose one array (128 KiB) goes through shared memory."""
    import numpy as np

    return {"i": i, "array": np.full(1 << 15, i, dtype=np.int32)}


def hold_items(address: str, index: int, ready: str) -> None:
    """A consumer process that takes 3 items, says so in the file `ready`, and holds them."""
    consumer = attach(address, index, timeout=20, prefetch=3)
    held = [next(consumer) for _ in range(3)]
    Path(ready).write_text(str(len(held)))
    time.sleep(HANG)


def serve_to_killable_consumers(address: str, method: str, ready: str) -> None:
    """An owner that serves two consumer processes started with `method` (sharing its
    resource tracker) and writes its pid and theirs to `ready` once both hold items."""
    fan = FanOut(MapIterator(native_range(10**6), small_array_item), 2, max_lag=4)
    fan.serve(address)
    context = multiprocessing.get_context(method)
    consumers = [
        context.Process(target=hold_items, args=(address, i, f"{ready}.{i}")) for i in range(2)
    ]
    for process in consumers:
        process.start()
    assert wait_until(lambda: all(Path(f"{ready}.{i}").exists() for i in range(2)), HANG)
    Path(ready).write_text(json.dumps([os.getpid(), *(p.pid for p in consumers)]))
    time.sleep(HANG)


@pytest.mark.parametrize("method", METHODS)
def test_an_owner_killed_together_with_its_consumer_processes_leaves_no_segment(
    method: str, tmp_path: Path
) -> None:
    # The owner runs in an interpreter of its own, as a job does: its resource tracker is
    # its own (shared with the consumers it starts), not this test process's.
    ready, stderr = tmp_path / "ready", tmp_path / "stderr"
    code = (
        "import test_fanout; test_fanout.serve_to_killable_consumers"
        f"({str(tmp_path / 'fan.sock')!r}, {method!r}, {str(ready)!r})"
    )
    path = os.pathsep.join(entry for entry in sys.path if entry)
    with open(stderr, "wb") as errors:
        owner = subprocess.Popen(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, stderr=errors
        )
    prefix = f"ibl_{owner.pid}_"

    def left() -> list[str]:
        return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]

    pids = [owner.pid]
    try:
        assert wait_until(lambda: ready.exists() and ready.read_text(), 60)
        pids = json.loads(ready.read_text())
        assert left()  # the items the consumers hold, and those kept for them
        for pid in pids:  # all at once: nobody is left to unlink anything
            os.kill(pid, signal.SIGKILL)
        owner.wait()
        assert wait_until(lambda: not left(), HANG), left()  # the tracker unlinked them
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        owner.wait()
    report = stderr.read_text()
    assert "leaked shared_memory objects" in report  # what it found, as it always says
    assert "No such file" not in report, report  # nobody unlinked a name behind its back
    assert "Traceback" not in report, report


# -- the ring of replies: each written once by the owner, read in place by every process --


def sized_bytes(i: int) -> bytes:
    """An item of 3,000 bytes, or of 9,000 every 7th (more than a quarter of a 16 KiB ring)."""
    return bytes([i % 251]) * (9000 if i % 7 == 6 else 3000)


def sized_digests(items: int) -> list[str]:
    return [_digest(sized_bytes(i)) for i in range(items)]


def sized_payload(items: int) -> int:
    """The bytes of the first `items` items."""
    return sum(len(sized_bytes(i)) for i in range(items))


def read_digests(address: str, index: int, out: str, late_s: float, ring: bool) -> None:
    """A consumer process that records its items' digests and how many bytes its socket
    brought; it unpickles each reply `late_s` late, and maps the ring only if `ring`."""
    from infinibatch_like.background import shm_arena, wire
    from infinibatch_like.stages import fanout_remote

    def no_ring(name: str, capacity: int) -> memoryview:
        raise OSError("another /dev/shm")

    if not ring:
        shm_arena.Ring.attach = staticmethod(no_ring)  # type: ignore[method-assign]
    received = [0]
    read_ready, unpickled = wire.FrameReader.read_ready, fanout_remote._unpickled

    def counted(reader: wire.FrameReader) -> bytearray | None:
        frame = read_ready(reader)
        received[0] += 0 if frame is None else len(frame)
        return frame

    def late(frame: Any) -> tuple[Any, ...]:
        time.sleep(late_s)
        return unpickled(frame)

    wire.FrameReader.read_ready = counted  # type: ignore[method-assign]
    fanout_remote._unpickled = late
    with attach(address, index, timeout=20, prefetch=4) as consumer:
        digests = [_digest(item) for item in consumer]
    Path(out).write_text(json.dumps({"digests": digests, "socket_bytes": received[0]}))


def read_in_processes(
    tmp_path: Path, items: int, late_s: list[float], ring: list[bool]
) -> list[dict[str, Any]]:
    """What `read_digests` processes (one per entry of `late_s`) recorded."""
    with FanOut(MapIterator(native_range(items), sized_bytes), len(late_s), max_lag=8) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        outs = [tmp_path / f"out{i}" for i in range(len(late_s))]
        got = recorded(read_digests, address, outs, late_s, ring)
    assert not owner_segments()  # the ring is gone with the fan-out
    return got  # type: ignore[no-any-return]


def test_consumer_processes_read_the_replies_from_the_ring_not_from_their_socket(
    tmp_path: Path,
) -> None:
    got = read_in_processes(tmp_path, 60, [0.0, 0.0], [True, True])
    expected = sized_digests(60)
    payload = sized_payload(60)
    for record in got:
        assert record["digests"] == expected
        assert record["socket_bytes"] < payload / 20  # where the replies lie, not their bytes


def test_a_consumer_reading_its_replies_late_gets_them_exactly_while_the_ring_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast consumer's replies fill a 16 KiB ring while the slow one has not read its
    own: those are not overwritten (the rest come through the sockets)."""
    from infinibatch_like.background import shm_arena

    monkeypatch.setattr(shm_arena, "CAPACITY", 16 << 10)
    got = read_in_processes(tmp_path, 80, [0.005, 0.0], [True, True])
    expected = sized_digests(80)
    assert [record["digests"] for record in got] == [expected, expected]


def test_a_consumer_process_that_cannot_map_the_ring_gets_its_replies_through_its_socket(
    tmp_path: Path,
) -> None:
    got = read_in_processes(tmp_path, 60, [0.0, 0.0], [False, True])
    expected = sized_digests(60)
    payload = sized_payload(60)
    assert [record["digests"] for record in got] == [expected, expected]
    assert got[0]["socket_bytes"] > payload
    assert got[1]["socket_bytes"] < payload / 20


def _start_target(target: Any, *args: Any) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    return process


def recorded(target: Any, address: str, outs: list[Path], *per_consumer: list[Any]) -> Any:
    """Run ``target(address, i, outs[i], *(values[i] for values in per_consumer))`` in a
    forked process for each consumer i, to its end; what each wrote to its out (JSON)."""
    processes = [
        _start_target(target, address, i, str(out), *(values[i] for values in per_consumer))
        for i, out in enumerate(outs)
    ]
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    return [json.loads(out.read_text()) for out in outs]


class CountedPickles:
    """An item that counts how often this process pickles it."""

    pickled = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        type(self).pickled += 1
        time.sleep(0.002)  # long enough for the other consumers' threads to ask for it too
        return (int, (self.value,))


def counted(x: int) -> CountedPickles:
    return CountedPickles(x)


def read_to_the_end(address: str, index: int) -> None:
    with attach(address, index, timeout=20) as consumer:
        assert list(consumer) == list(range(60))


def test_each_item_is_pickled_once_whatever_the_number_of_consumer_processes(
    tmp_path: Path,
) -> None:
    CountedPickles.pickled = 0
    with FanOut(MapIterator(native_range(60), counted), 4, max_lag=8) as fan:
        address = fan.serve(str(tmp_path / "fan.sock"))
        processes = [_start_target(read_to_the_end, address, i) for i in range(4)]
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
    assert CountedPickles.pickled == 60


def native_range(n: int) -> NativeCheckpointableIterator:
    return NativeCheckpointableIterator(list(range(n)))
