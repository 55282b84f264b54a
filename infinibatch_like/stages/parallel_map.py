"""Parallel map: a transform applied by worker processes or threads, in order, with exact
checkpoints."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from typing import Any

from .._core.checks import require_callable, require_checkpointable, require_int
from .._core.probe import Gauges
from .._core.protocol import CheckpointableIterator, State
from .._core.stage import fast_iterator, skip_items, source_state
from ..background.cursor import ReplayCursor
from ..background.errors import as_exception
from ..background.lifecycle import ProcessesRefused, get_context, warn_thread_fallback
from ..background.messages import Result, Task
from ..background.pool import Pool, ProcessPool, ThreadPool
from ..background.stage import BackgroundStage, Runner
from ._failures import Guarded
from .bad_records import BudgetedStage, OnError

_MODES = ("process", "thread")


class _Dispatcher:
    """Reads the source into tasks, recording a snapshot in the cursor every
    `snapshot_every` source items (and right after the replay of a checkpoint)."""

    def __init__(
        self, source: CheckpointableIterator[Any], cursor: ReplayCursor, snapshot_every: int
    ) -> None:
        self._pull = fast_iterator(source)
        self._getstate = partial(source_state, source)
        self._cursor, self._every = cursor, snapshot_every
        self.dispatched = cursor.consumed
        owner, what = "ParallelMapIterator", "its source after the snapshot"
        skip_items(self._pull, self.dispatched, owner, what)
        if self.dispatched:
            cursor.snapshot(self.dispatched, self._getstate())
        self._next_snapshot = self.dispatched + snapshot_every
        self.exhausted = False
        self.error: BaseException | None = None
        """What the source raised, after the items that came before it."""

    def take(self, size: int) -> list[Any]:
        """Up to `size` items of the source (fewer at its end or at an error)."""
        items: list[Any] = []
        while len(items) < size and not self.exhausted:
            if self.dispatched == self._next_snapshot:
                self._cursor.snapshot(self.dispatched, self._getstate())
                self._next_snapshot += self._every
            want = min(size - len(items), self._next_snapshot - self.dispatched)
            before = len(items)
            try:
                items.extend(islice(self._pull, want))  # keeps what came before an error
            except Exception as error:
                self.error, self.exhausted = error, True
            self.dispatched += len(items) - before
            if len(items) - before < want and not self.exhausted:
                self.exhausted = True
                self._cursor.snapshot(self.dispatched, self._getstate())
        return items


class _MapRunner(Runner):
    """Feeds tasks to a `Pool` and yields their results in order."""

    def __init__(
        self,
        source: CheckpointableIterator[Any],
        snapshot_every: int,
        transform: Callable[[Any], Any],
        num_workers: int,
        task_size: int,
        tasks_in_flight: int,
        mode: str,
        start_method: str | None,
        batched: bool,
    ) -> None:
        super().__init__(source, snapshot_every)
        self.batched = batched
        self.transform, self.num_workers, self.task_size = transform, num_workers, task_size
        self.tasks_in_flight, self.mode, self.start_method = tasks_in_flight, mode, start_method
        self.pulls_source_in = "consumer"  # it dispatches its source's items itself
        self.pool: Pool | None = None
        self.dispatcher: _Dispatcher | None = None
        self.in_flight: deque[Task] = deque()
        self.done: dict[int, Result] = {}
        self.number = 0

    def _start(self) -> None:
        self.in_flight.clear()
        self.done.clear()
        self.dispatcher = _Dispatcher(self.source, self.cursor, self.snapshot_every)
        self.fill()

    def fill(self) -> None:
        """Submit tasks until `tasks_in_flight` are in flight or the source ends."""
        dispatcher = self.dispatcher
        assert dispatcher is not None
        while len(self.in_flight) < self.tasks_in_flight and not dispatcher.exhausted:
            first = dispatcher.dispatched
            items = dispatcher.take(self.task_size)
            if not items:
                return
            if self.pool is None:
                self.pool = self._new_pool()
            task = Task(self.number, items, self.probe is not None, first)
            self.number += 1
            self.pool.submit(task)
            self.in_flight.append(task)

    def _new_pool(self) -> Pool:
        name = "ParallelMapIterator"
        if self.mode == "process":
            try:
                return ProcessPool(
                    self.transform, self.num_workers, name, self.start_method, self.batched
                )
            except ProcessesRefused as error:
                warn_thread_fallback(name, error)
        return ThreadPool(self.transform, self.num_workers, name, self.batched)

    def _gauges(self) -> Gauges:
        """Tasks in flight over `tasks_in_flight`, their items, the workers."""
        tasks = list(self.in_flight)
        in_flight = sum(len(task.items) for task in tasks)
        return Gauges(len(tasks) / self.tasks_in_flight, in_flight, self.num_workers)

    def stop(self) -> None:
        pool, self.pool, self.dispatcher = self.pool, None, None
        if pool is not None:
            pool.shutdown()

    def _result(self, number: int) -> Result:
        """The result of task `number`, waiting for it."""
        while number not in self.done:
            assert self.pool is not None
            result = self.pool.receive()
            self.done[result.number] = result
        return self.done.pop(number)

    def generate(self) -> Iterator[Any]:
        self.start()
        dispatcher, cursor = self.dispatcher, self.cursor
        assert dispatcher is not None
        try:
            while self.in_flight:
                result = self._result(self.in_flight.popleft().number)
                if result.busy_s and self.probe is not None:
                    self.probe.worker_busy_s += result.busy_s
                if result.failure is None:
                    self.fill()  # keep the workers busy while the consumer takes these
                yield from cursor.serve(result.outputs)
                if result.failure is not None:
                    raise as_exception(result.failure)
                cursor.served()
            if dispatcher.error is not None:
                raise dispatcher.error
        finally:
            if self.dispatcher is dispatcher:  # not restarted by a restore meanwhile
                self.stop()


class ParallelMapIterator(BudgetedStage[Any], BackgroundStage[Any]):
    """Yields ``transform(item)`` for each item of the source, like `MapIterator`, with the
    transform running in `num_processes` worker processes (or threads).

    The consumer's process reads the source and sends tasks of up to
    `num_items_per_process` items to the workers, keeping up to `tasks_in_flight` tasks
    in flight; results come back in order and stream out as soon as the oldest task is done
    (no waiting for a whole round). The output, errors included, is exactly
    `MapIterator`'s: the items before a failing one are all delivered. The pool starts at
    the first ``next()`` (or at `start`) and stops at ``close()``, on garbage collection,
    at interpreter exit and when the source ends. It works nested inside a process
    `PrefetchIterator` (the pool then lives in the prefetcher's worker), around one, and
    inside DataLoader worker processes (whose death stops it).

    Args:
        source_iterator: the source; it is reset.
        transform: the function to apply. Under the ``"spawn"`` and ``"forkserver"`` start
            methods it is sent to the workers with pickle, or with cloudpickle (``pip
            install infinibatch_like[parallel]``) for lambdas and local functions; what
            cannot be sent (an open file, a lock) raises ``pickle.PicklingError`` naming it.
        num_processes: worker processes, or threads with ``mode="thread"`` (>= 1).
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
        mode: ``"process"`` (worker processes: CPU-bound Python transforms run in
            parallel; items and results are pickled) or ``"thread"`` (worker threads of
            this process: for transforms that release the GIL, such as decompression,
            image decoding, numpy or remote reads; nothing is pickled).
        on_error: ``"raise"`` (default), ``"skip"`` (`DEFAULT_SKIP_POLICY`) or a
            `SkipPolicy`: an item whose transform raises an Exception (in a worker process
            or thread) is skipped and entered in the ledger (`skipped`), within the
            policy's budget. Not with `batched`.
        batched: the transform is called once per task with the list of its items (up
            to `num_items_per_process`) and returns a sequence of exactly one output per
            item, in order (a tokenizer's ``encode_batch``, a numpy function): see
            `BatchMapIterator`. Checkpoints stay exact between any two items; a batch
            whose transform raises yields none of its outputs. Another number of
            outputs raises ValueError naming this stage.

    Raises:
        ValueError: for an argument out of range, an unknown mode or start method.
        Exception: whatever the source or the transform raises, in the consumer at the
            item that raised it, with the worker's traceback as ``__cause__`` and a note
            naming the stage; ``getstate()`` then points at that item. An output that a
            worker process cannot pickle fails the same way, at its item.
        WorkerError: (a RuntimeError) if a worker process dies, within a second or so.
        SkipBudgetExceeded: with a `SkipPolicy`, when more items fail than it allows;
            ``getstate()`` then raises (restore an earlier checkpoint).

    Checkpoint:
        ``{"source", "replay"}``: the source's state recorded at or before the consumer's
        position and the number of items consumed since (at most `snapshot_every`, also
        after restores; a state with more is refused). Size: one source state plus an int.
        A restore sets the source to that state and skips `replay` source items without
        transforming them: at most `snapshot_every` re-read items. Results in flight are
        computed again. With a `SkipPolicy`, also ``"skips"``: the budget window and the
        ledger (bounded by ``keep_last``); a restore skips the same items again.
    """

    _not_elastic = "its replay counts items of this rank's stream"

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
        mode: str = "process",
        on_error: OnError = "raise",
        batched: bool = False,
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
        if mode not in _MODES:
            raise ValueError(f"{owner}: mode must be one of {_MODES}, got {mode!r}")
        if mode == "process":
            get_context(owner, start_method)
        if type(batched) is not bool:
            raise TypeError(f"{owner}: batched must be a bool, got {batched!r}")
        if batched and on_error != "raise":
            raise ValueError(f"{owner}: on_error={on_error!r} cannot be combined with batched=True")
        self._init_budget(owner, on_error)
        runner = _MapRunner(
            source_iterator,
            snapshot_every,
            transform if self._budget is None else Guarded(transform),
            num_processes,
            num_items_per_process,
            tasks_in_flight,
            mode,
            start_method,
            batched,
        )
        self._init_background(source_iterator, runner)
        self._restore(None)

    def _state(self) -> State:
        return {**BackgroundStage._state(self), **self._skip_fields(self._seen)}

    def _restore(self, state: State | None) -> None:
        BackgroundStage._restore(self, state)
        self._restore_budget(state)
        if self._budget is not None:
            self._iterator = self._without_bad_records(self._iterator)
