"""Watchdog: a consumer waiting too long is reported with the stage it waits on and the
stacks of every worker thread and process; raise mode raises; nothing leaks."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like.background import stacks
from infinibatch_like.background import watchdog as watchdog_module
from infinibatch_like.background.lifecycle import worker_pids
from infinibatch_like.background.watchdog import StallError, Watchdog


class BlockingRead:
    """Returns its item; item 2 waits until the file `gate` exists (in any process)."""

    def __init__(self, gate: Path) -> None:
        self.gate = gate

    def __call__(self, item: int) -> int:
        if item == 2:
            wait_for_gate(self.gate)
        return item


def wait_for_gate(gate: Path) -> None:
    while not gate.exists():
        time.sleep(0.01)


def pipeline(gate: Path, mode: str) -> Watchdog[str] | Any:
    source = it.MapIterator(it.NativeCheckpointableIterator([1, 2, 3]), BlockingRead(gate))
    return it.MapIterator(it.PrefetchIterator(source, 4, mode=mode), str)


@pytest.fixture
def no_leaks() -> Any:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        set(threading.enumerate()) - before or multiprocessing.active_children()
    ):
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_stall_is_logged_with_the_stage_and_the_workers_stacks_then_waiting_goes_on(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    gate = tmp_path / "gate"
    reported = threading.Event()

    class Release(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reported.set()
            gate.touch()

    release = Release(logging.WARNING)
    logging.getLogger("infinibatch_like").addHandler(release)
    try:
        with caplog.at_level(logging.WARNING, logger="infinibatch_like"), Watchdog(
            pipeline(gate, mode), timeout_s=0.4
        ) as watched:
            assert next(watched) == "1"
            assert next(watched) == "2"  # reported, then released by the handler
            assert list(watched) == ["3"]
    finally:
        logging.getLogger("infinibatch_like").removeHandler(release)
    assert reported.is_set()
    report = "\n".join(r.getMessage() for r in caplog.records if "Watchdog" in r.getMessage())
    kind = "worker processes [" if mode == "process" else "worker threads"
    assert (
        "Watchdog: no item reached the consumer for 0.4 s: MapIterator.source > PrefetchIterator "
        "is waiting on its source MapIterator.source > NativeCheckpointableIterator, produced by "
        "its "
        f"{kind}"
    ) in report
    worker = "Worker process " if mode == "process" else 'Thread "infinibatch_like.Prefetch'
    stacks = report[report.index(worker):]
    assert "in wait_for_gate" in stacks
    assert "in __call__\n    wait_for_gate(self.gate)" in stacks


class OpenLater(logging.Handler):
    """Opens `gate` one second after a report: a worker thread stuck in user code cannot
    be stopped, so the PrefetchIterator that the StallError stops waits for it."""

    def __init__(self, gate: Path) -> None:
        super().__init__(logging.WARNING)
        self.gate = gate

    def emit(self, record: logging.LogRecord) -> None:
        threading.Timer(1.0, self.gate.touch).start()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_raise_mode_raises_within_the_timeout_naming_the_stage(
    mode: str, tmp_path: Path, no_leaks: None
) -> None:
    gate = tmp_path / "gate"
    watched = Watchdog(pipeline(gate, mode), timeout_s=0.4, action="raise")
    opener = OpenLater(gate)
    if mode == "thread":
        logging.getLogger("infinibatch_like").addHandler(opener)
    try:
        assert next(watched) == "1"
        start = time.monotonic()
        with pytest.raises(StallError, match=r"MapIterator\.source > PrefetchIterator is waiting "
                           r"on its source MapIterator\.source > NativeCheckpointableIterator"):
            next(watched)
        assert time.monotonic() - start < 0.4 * 1.25 + 2 + 1.5  # check period, stacks, slack
        with pytest.raises(RuntimeError, match="MapIterator stopped after an error "
                           r"\(StallError: Watchdog: no item"):
            next(watched)
    finally:
        logging.getLogger("infinibatch_like").removeHandler(opener)
        gate.touch()
        watched.close()


def test_time_outside_next_is_not_a_stall_and_states_pass_through(
    caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    source = it.NativeCheckpointableIterator(list(range(5)))
    with caplog.at_level(logging.WARNING, logger="infinibatch_like"), Watchdog(
        source, timeout_s=0.2
    ) as watched:
        assert next(watched) == 0
        time.sleep(0.5)  # the training step: the consumer is not waiting
        assert next(watched) == 1
        state = watched.getstate()
        assert state == source.getstate()
        watched.setstate(None)
        assert next(watched) == 0
        watched.setstate(state)
        assert list(watched) == [2, 3, 4]
    assert not caplog.records


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"timeout_s": 0}, ValueError, "Watchdog: timeout_s must be > 0, got 0"),
        ({"timeout_s": True}, TypeError, "Watchdog: timeout_s must be a number, got True"),
        ({"timeout_s": 1, "action": "kill"}, ValueError,
         r"Watchdog: action must be one of \('log', 'raise'\), got 'kill'"),
        ({"pipeline": [1], "timeout_s": 1}, ValueError,
         "Watchdog: pipeline must be a CheckpointableIterator, got list"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type, message: str) -> None:
    arguments = {"pipeline": it.NativeCheckpointableIterator([1]), **kwargs}
    with pytest.raises(error, match=message):
        Watchdog(**arguments)


class ReleaseAfter(logging.Handler):
    """Counts the watchdog's stall reports; opens `gate` after the `count`-th."""

    def __init__(self, gate: Path, count: int) -> None:
        super().__init__(logging.WARNING)
        self.gate, self.count, self.reports = gate, count, []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Watchdog: no item reached the consumer"):
            self.reports.append(record.getMessage())
            if len(self.reports) == self.count:
                self.gate.touch()


@pytest.mark.parametrize(
    ("planted", "method"), [("directory", "fork"), ("symlink", "fork"), ("directory", "spawn")]
)
def test_files_planted_in_a_shared_tmpdir_do_not_stop_the_stall_reports(
    planted: str, method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    shared = tmp_path / "tmp"  # stands for a /tmp that other users write to
    shared.mkdir()
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    gate = tmp_path / "gate"
    source = it.MapIterator(it.NativeCheckpointableIterator([1, 2, 3]), BlockingRead(gate))
    prefetched = it.PrefetchIterator(source, 4, start_method=method)
    assert next(prefetched) == 1  # the worker has started: the watchdog starts afterwards
    watched = Watchdog(prefetched, timeout_s=0.3)
    counter = ReleaseAfter(gate, 3)
    logging.getLogger("infinibatch_like").addHandler(counter)
    deadline = threading.Timer(20, gate.touch)  # the test fails, rather than hangs, without reports
    deadline.start()
    try:
        with watched:
            (pid,) = worker_pids()
            for name in (f"infinibatch_like-stacks-{pid}.txt", f"{pid}.txt"):
                if planted == "directory":
                    (shared / name).mkdir()
                else:
                    (shared / name).symlink_to(victim)
            assert list(watched) == [2, 3]
    finally:
        logging.getLogger("infinibatch_like").removeHandler(counter)
        deadline.cancel()
        gate.touch()
    assert len(counter.reports) == 3
    assert all(f"Worker process {pid}:\n" in report for report in counter.reports)
    assert all("in wait_for_gate" in report for report in counter.reports)
    assert victim.read_text() == "keep me"
    kind = Path.is_dir if planted == "directory" else Path.is_symlink
    assert all(kind(shared / name) for name in (f"infinibatch_like-stacks-{pid}.txt", f"{pid}.txt"))


def test_a_report_that_cannot_get_the_workers_stacks_still_reports_the_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    def broken(pids: Any, timeout: float) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(watchdog_module, "worker_stacks", broken)
    gate = tmp_path / "gate"
    counter = ReleaseAfter(gate, 2)
    logging.getLogger("infinibatch_like").addHandler(counter)
    deadline = threading.Timer(20, gate.touch)
    deadline.start()
    try:
        with Watchdog(pipeline(gate, "process"), timeout_s=0.3) as watched:
            assert list(watched) == ["1", "2", "3"]
    finally:
        logging.getLogger("infinibatch_like").removeHandler(counter)
        deadline.cancel()
        gate.touch()
    assert len(counter.reports) == 2
    assert all(
        "the stacks of the worker processes could not be collected (OSError: [Errno 28] No "
        "space left on device)" in report
        for report in counter.reports
    )
    assert all('Thread "MainThread"' in report for report in counter.reports)


def test_workers_answer_in_a_private_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stacks, "_ANSWERS", [])  # this process's, chosen afresh
    directory = Path(stacks.answers_dir())
    assert directory.parent == Path(tempfile.gettempdir())
    assert directory.name.startswith("infinibatch_like-stacks-")
    assert len(directory.name) == len("infinibatch_like-stacks-") + 24  # 96 random bits
    assert not directory.exists()  # until a report asks for stacks
    try:
        assert stacks.open_answers_dir() == str(directory)
        assert directory.stat().st_mode & 0o777 == 0o700
        assert directory.stat().st_uid == os.getuid()
        assert stacks.open_answers_dir() == str(directory)  # ours: used again
    finally:
        directory.rmdir()


@pytest.mark.parametrize("planted", ["symlink", "open directory", "file"])
def test_something_planted_at_the_private_directory_is_refused(
    planted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "infinibatch_like-stacks-guessed"
    if planted == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    elif planted == "open directory":
        path.mkdir()
        path.chmod(0o777)
    else:
        path.write_text("")
    monkeypatch.setattr(stacks, "_ANSWERS", [str(path)])
    with pytest.raises(PermissionError, match="exists and is not a private directory of this"):
        stacks.open_answers_dir()


METHODS = multiprocessing.get_all_start_methods()


def read_in_a_child_process() -> None:
    """Reads with a worker process, whose stacks it asks for (as a stall report does)."""
    # an endless source: a worker that reached its source's end could exit before asked
    with it.PrefetchIterator(it.NativeCheckpointableIterator(range(10**12)), 2) as items:
        assert next(items) == 0
        (pid,) = worker_pids()
        assert f"Worker process {pid}:\n" in stacks.worker_stacks([pid], 5.0)
        assert os.path.isdir(stacks.answers_dir())
        assert next(items) == 1


CHILD = """
import multiprocessing, sys
sys.path[:0] = [{test!r}, {helpers!r}]
from test_watchdog import read_in_a_child_process

if __name__ == "__main__":
    child = multiprocessing.get_context({method!r}).Process(target=read_in_a_child_process)
    child.start()
    child.join()
    assert child.exitcode == 0, child.exitcode
    read_in_a_child_process()
"""


@pytest.mark.parametrize("method", METHODS)
def test_the_private_directories_are_removed_at_exit(method: str, tmp_path: Path) -> None:
    # a multiprocessing child (a DataLoader worker) that starts workers makes its own
    script = tmp_path / "run.py"
    script.write_text(CHILD.format(
            test=str(Path(__file__).parent), helpers=str(Path(__file__).parents[1]), method=method
        ))
    private = tmp_path / "tmp"
    private.mkdir()
    environment = {**os.environ, "TMPDIR": str(private)}
    subprocess.run([sys.executable, str(script)], env=environment, check=True, timeout=60)
    assert os.listdir(private) == []
