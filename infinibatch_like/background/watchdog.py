"""Stalls: a watchdog that reports which stage a waiting consumer is stuck on, with the
stacks of every worker thread and process."""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any, Literal, TypeVar

from .._core.checks import require_checkpointable
from .._core.graph import chain, sources_of, walk
from .._core.protocol import CheckpointableIterator, State
from .._core.stage import Stage
from .lifecycle import (
    POLL_S,
    Resource,
    cancel_interrupt,
    interrupt,
    worker_pids,
)
from .stacks import thread_stacks, worker_stacks
from .stage import BackgroundStage

T = TypeVar("T")

logger = logging.getLogger("infinibatch_like")

_ACTIONS = ("log", "raise")
WORKER_ANSWER_S = 2.0
"""How long a report waits for the stacks of the worker processes (seconds)."""


class StallError(RuntimeError):
    """No item reached the consumer within a `Watchdog`'s timeout (with ``action="raise"``).

    The message names the stage the consumer was waiting on; the pipeline is stopped
    (restore a checkpoint with ``setstate`` to go on, or close it).
    """


class Watchdog(CheckpointableIterator[T]):
    """Yields `pipeline`'s items, and reports when the consumer waits too long for one.

    When a ``next()`` has waited `timeout_s` seconds without an item, the watchdog logs
    (warning, logger ``"infinibatch_like"``) which stage the consumer is waiting on, by
    its chain path, and that stage's source (and its worker processes), followed by the
    stack of every thread of this process and of every worker process (asked with a
    signal; Linux). Then it goes on waiting and reports again after each further
    `timeout_s`; with ``action="raise"`` it raises `StallError` in the consumer instead.
    Time the consumer spends outside ``next()`` (training) never counts.

    The check runs in a thread (``infinibatch_like.Watchdog``) that wakes every
    ``min(timeout_s / 4, 1)`` seconds and compares two counters that ``next()``
    increments: no lock and no clock per item, one Python call (about a microsecond):
    wrap the batches (one item per step), not the records. A report comes between `timeout_s` and
    ``1.25 * timeout_s`` after the wait began (plus up to 2 s for the stacks).

    With ``action="raise"``, the consumer's wait is ended where it polls its background
    workers (every 0.1 s: a `PrefetchIterator`, a `ParallelMapIterator`, a
    `SelectManyIterator` reading ahead), at a point where it holds no lock, and the
    `StallError` goes up through the pipeline, stopping it. A wait in code running in
    the consumer's own thread (a source without a background stage above it) cannot be
    ended safely from outside: it is reported, not raised.

    Args:
        pipeline: the pipeline to watch (the one you iterate).
        timeout_s: how long a ``next()`` may wait for an item (> 0 seconds).
        action: ``"log"`` (default) or ``"raise"``.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
        StallError: from ``next()``, with ``action="raise"``.

    Checkpoint:
        The pipeline's own: `getstate` and `setstate` pass through, so a state taken with
        the watchdog restores without it and the other way round.
    """

    def __init__(
        self,
        pipeline: CheckpointableIterator[T],
        timeout_s: float,
        action: Literal["log", "raise"] = "log",
    ) -> None:
        require_checkpointable("Watchdog", "pipeline", pipeline)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"Watchdog: timeout_s must be a number, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s must be > 0, got {timeout_s}")
        if action not in _ACTIONS:
            raise ValueError(f"Watchdog: action must be one of {_ACTIONS}, got {action!r}")
        self._pipeline = pipeline
        self._monitor = _Monitor(pipeline, float(timeout_s), action)
        self._finalizer = weakref.finalize(self, self._monitor.stop)

    def __next__(self) -> T:
        monitor = self._monitor
        if monitor.thread is None:
            monitor.start()
        monitor.calls += 1
        try:
            return next(self._pipeline)
        finally:
            monitor.returns += 1

    def getstate(self) -> State:
        return self._pipeline.getstate()

    def setstate(self, checkpoint: State | None) -> None:
        self._pipeline.setstate(checkpoint)

    def close(self) -> None:
        """Stop the watchdog's thread and close the pipeline (idempotent)."""
        self._monitor.stop()
        self._pipeline.close()


class _Monitor:
    """The watchdog's thread and the counters it reads; holds no reference to the
    `Watchdog`, so that garbage collection of the watchdog stops it."""

    def __init__(self, pipeline: CheckpointableIterator[Any], timeout_s: float, action: str):
        self.pipeline, self.timeout_s, self.action = pipeline, timeout_s, action
        self.calls = self.returns = 0
        self.consumer = 0
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.consumer = threading.get_ident()
        self.thread = threading.Thread(
            target=self._run, name="infinibatch_like.Watchdog", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        interval = min(self.timeout_s / 4, 1.0)
        watched, since, reports = -1, time.monotonic(), 0
        while not self._stop.wait(interval):
            calls, returns, now = self.calls, self.returns, time.monotonic()
            if calls == returns or calls != watched:  # not waiting, or a new wait
                watched, since, reports = calls, now, 0
                continue
            if now - since >= self.timeout_s * (reports + 1):
                reports += 1
                summary = self._report(now - since)
                if self.action == "raise" and self.calls == calls and self.returns < calls:
                    interrupt(self.consumer, StallError(summary))
                    while not self._stop.wait(POLL_S) and self.returns < calls:
                        pass  # until the consumer raises it, or the wait ends otherwise
                    cancel_interrupt(self.consumer)
                    return

    def _report(self, waited: float) -> str:
        """Log the stall with every stack; its summary."""
        summary = f"Watchdog: no item reached the consumer for {waited:.1f} s: " + describe_wait(
            self.pipeline, self.consumer
        )
        stacks = thread_stacks()
        try:
            workers = worker_stacks(worker_pids(), WORKER_ANSWER_S)
        except Exception as error:  # the stall is reported all the same
            workers = (
                "the stacks of the worker processes could not be collected "
                f"({type(error).__name__}: {error})"
            )
        logger.warning("%s\n\n%s\n%s", summary, stacks, workers)
        return summary


def describe_wait(pipeline: CheckpointableIterator[Any], consumer: int) -> str:
    """Which stage of `pipeline` the thread `consumer` waits in, by its chain path, and
    what that stage waits on: its source and its workers."""
    paths: dict[int, str] = {}
    owners: dict[int, Stage[Any]] = {}
    for place in walk(pipeline):
        stage = place.stage
        if not isinstance(stage, Stage):
            continue
        paths[id(stage)] = place.path
        owners[id(stage)] = stage
        if isinstance(stage, BackgroundStage):
            runner = stage._runner
            owners[id(runner)] = stage
            for worker in _workers(stage):
                owners[id(worker)] = stage
    frame = sys._current_frames().get(consumer)
    waiting: Stage[Any] | None = None
    while frame is not None and waiting is None:
        waiting = owners.get(id(frame.f_locals.get("self")))
        frame = frame.f_back
    if waiting is None:
        return f"the consumer is inside next() of {type(pipeline).__name__}"
    path = paths[id(waiting)]
    sources = " and ".join(chain(source) for source in sources_of(waiting)) or "(none)"
    text = f"{path} is waiting on its source {sources}"
    pids = [pid for worker in _workers(waiting) for pid in worker.pids()]
    if isinstance(waiting, BackgroundStage):
        kind = f"worker processes {pids}" if pids else "worker threads"
        text += f", produced by its {kind}"
    return text


def _workers(stage: Stage[Any]) -> list[Resource]:
    """The worker channel or pool of a background stage, if started."""
    if not isinstance(stage, BackgroundStage):
        return []
    runner = stage._runner
    found = [getattr(runner, name, None) for name in ("channel", "pool")]
    return [worker for worker in found if isinstance(worker, Resource)]
