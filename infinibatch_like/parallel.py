"""Parallel map: a transform applied in worker processes, in order, with exact checkpoints."""

from __future__ import annotations

import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, ClassVar

from . import _workers
from ._base import (
    CheckpointableIterator,
    Stage,
    State,
    StateMismatchError,
    fast_iterator,
    require_callable,
    require_checkpointable,
    require_int,
)


class _MapRunner:
    """Feeds tasks to the pool and yields results in order; tracks the consumer's position
    against the source snapshots taken while dispatching. Holds no reference to the stage."""

    def __init__(
        self,
        source: CheckpointableIterator[Any],
        transform: Callable[[Any], Any],
        num_processes: int,
        task_size: int,
        tasks_in_flight: int,
        snapshot_every: int,
        start_method: str | None,
    ) -> None:
        self.source, self.transform = source, transform
        self.num_processes, self.task_size = num_processes, task_size
        self.tasks_in_flight = tasks_in_flight
        self.snapshot_every, self.start_method = snapshot_every, start_method
        self.pool: _workers.MapPool | None = None
        self.reset({}, 0)

    def reset(self, snapshot: State, replay: int) -> None:
        # (position, source state there); positions count source items from the first
        # snapshot. The first entry is at or before the consumer's position.
        self.snapshots: deque[tuple[int, State]] = deque([(0, snapshot)])
        self.base = replay
        self.batch: Iterator[Any] = iter(())
        self.batch_length = 0

    def state(self) -> State:
        consumed = self.base + self.batch_length - operator.length_hint(self.batch)
        position, snapshot = self.snapshots[0]
        for later, later_snapshot in self.snapshots:
            if later > consumed:
                break
            position, snapshot = later, later_snapshot
        return {"source": snapshot, "replay": consumed - position}

    def stop(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown()

    def generate(self) -> Iterator[Any]:
        source, every, snapshots = self.source, self.snapshot_every, self.snapshots
        pull = fast_iterator(source)
        getstate = source.getstate
        dispatched = self.base
        for index in range(dispatched):
            try:
                next(pull)
            except StopIteration:
                raise StateMismatchError(
                    f"the checkpoint replays {dispatched} items after its snapshot, but the "
                    f"source ends after {index}",
                    ("ParallelMapIterator",),
                ) from None
        next_snapshot = (dispatched // every + 1) * every
        in_flight: deque[tuple[int, int]] = deque()  # (task number, item count)
        done: dict[int, tuple[list[Any], _workers.Report | None]] = {}
        number = 0
        exhausted = False
        source_error: BaseException | None = None
        limit = self.tasks_in_flight
        pool: _workers.MapPool | None = None

        def take() -> list[Any]:
            nonlocal dispatched, next_snapshot, exhausted, source_error
            items: list[Any] = []
            while len(items) < self.task_size:
                if dispatched == next_snapshot:
                    snapshots.append((dispatched, getstate()))
                    next_snapshot += every
                want = min(self.task_size - len(items), next_snapshot - dispatched)
                before = len(items)
                try:
                    items.extend(islice(pull, want))  # keeps what came before an error
                except Exception as error:
                    source_error, exhausted = error, True
                    dispatched += len(items) - before
                    break
                got = len(items) - before
                dispatched += got
                if got < want:
                    exhausted = True
                    snapshots.append((dispatched, getstate()))
                    break
            return items

        def fill() -> None:
            nonlocal number, pool
            while len(in_flight) < limit and not exhausted:
                items = take()  # a source error is raised when the consumer gets there
                if not items:
                    return
                if pool is None:
                    pool = self.pool = _workers.MapPool(
                        self.transform,
                        self.num_processes,
                        "ParallelMapIterator",
                        self.start_method,
                    )
                pool.submit(number, items)
                in_flight.append((number, len(items)))
                number += 1

        try:
            while True:
                fill()
                if not in_flight:
                    if source_error is not None:
                        raise source_error
                    return
                head, count = in_flight[0]
                while head not in done:
                    assert pool is not None
                    finished, outputs, report = pool.receive()
                    done[finished] = outputs, report
                outputs, report = done.pop(head)
                in_flight.popleft()
                if report is None:
                    fill()  # keep the workers busy while the consumer works through this task
                batch = iter(outputs)
                self.batch, self.batch_length = batch, len(outputs)
                yield from batch
                if report is not None:
                    _workers.raise_report(report)
                self.base += count
                self.batch_length = 0
                while len(snapshots) > 1 and snapshots[1][0] <= self.base:
                    snapshots.popleft()
        finally:
            if self.pool is pool:
                self.stop()


class ParallelMapIterator(Stage[Any]):
    """Yields ``transform(item)`` for each item of the source, like `MapIterator`, with the
    transform running in `num_processes` worker processes.

    The consumer's process reads the source and sends tasks of up to
    `num_items_per_process` items to the workers, keeping up to `tasks_in_flight` tasks
    in flight; results come back in order and stream out as soon as the oldest task is done
    (no waiting for a whole round). The output, errors included, is exactly
    `MapIterator`'s. The pool starts at the first ``next()`` and stops at ``close()``, on
    garbage collection, at interpreter exit and when the source ends. It works nested
    inside a process `PrefetchIterator` (the pool then lives in the prefetcher's worker)
    and around one.

    Args:
        source_iterator: the source; it is reset.
        transform: the function to apply; under the ``"spawn"`` and ``"forkserver"`` start
            methods it must pickle (a module-level function or ``functools.partial``).
        num_processes: worker processes (>= 1).
        num_items_per_process: items per task (>= 1): larger tasks cost less overhead,
            smaller ones give the first result sooner.
        tasks_in_flight: how many tasks the workers may have queued, in progress or done
            while the consumer works through the results of another (>= 1; None:
            ``2 * num_processes``). More smooths over bursts of work in the consumer (e.g.
            a shuffle block being read) at the cost of memory: up to
            ``(tasks_in_flight + 1) * num_items_per_process`` items and their results.
        start_method: multiprocessing start method of the workers (None: the default).
        snapshot_every: the source's state is recorded every `snapshot_every` items while
            dispatching (>= 1); this bounds what a restore replays.

    Raises:
        Exception: whatever the transform raises, in the consumer at the item that raised
            it, with the worker's traceback as ``__cause__`` and a note naming the stage.
        WorkerError: (a RuntimeError) if a worker process dies.

    Checkpoint:
        ``{"source", "replay"}``: the source's state recorded at or before the consumer's
        position and the number of items consumed since (< `snapshot_every`, except right
        after a restore). Size: one source state plus an int. A restore sets the source to
        that state and skips `replay` source items without transforming them: at most
        `snapshot_every` re-read items. Results in flight are computed again.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"source": dict, "replay": int}

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        transform: Callable[[Any], Any],
        num_processes: int,
        num_items_per_process: int,
        *,
        tasks_in_flight: int | None = None,
        start_method: str | None = None,
        snapshot_every: int = 100,
    ) -> None:
        owner = "ParallelMapIterator"
        require_checkpointable(owner, "source_iterator", source_iterator)
        require_callable(owner, "transform", transform)
        require_int(owner, "num_processes", num_processes, 1)
        require_int(owner, "num_items_per_process", num_items_per_process, 1)
        if tasks_in_flight is None:
            tasks_in_flight = 2 * num_processes
        require_int(owner, "tasks_in_flight", tasks_in_flight, 1)
        require_int(owner, "snapshot_every", snapshot_every, 1)
        _workers.get_context(owner, start_method)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._runner = _MapRunner(
            source_iterator,
            transform,
            num_processes,
            num_items_per_process,
            tasks_in_flight,
            snapshot_every,
            start_method,
        )
        self._finalizer = weakref.finalize(self, self._runner.stop)
        self._restore(None)

    def _state(self) -> State:
        return self._runner.state()

    def _restore(self, state: State | None) -> None:
        runner = self._runner
        runner.stop()
        self.restore_source(self._source, None if state is None else state["source"], "source")
        if state is None:
            runner.reset(self._source.getstate(), 0)
        else:
            if state["replay"] < 0:
                raise self.mismatch(f"'replay' must be >= 0, got {state['replay']}")
            runner.reset(state["source"], state["replay"])
        self._iterator = runner.generate()

    def close(self) -> None:
        """Stop the worker processes, then close the source. Idempotent; afterwards
        ``next()`` and ``setstate()`` raise RuntimeError."""
        if not self._closed:
            self._runner.stop()
        super().close()
