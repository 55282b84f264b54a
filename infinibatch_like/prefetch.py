"""Prefetching: produce a source's items ahead of the consumer, in a thread or a process."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from . import _workers
from ._base import CheckpointableIterator, Stage, State, require_checkpointable, require_int

_MODES = ("process", "thread")


class _Cursor:
    """The consumer's position: a snapshot of the source's state, and how many items were
    consumed since (`base` plus the consumed part of the current `batch`)."""

    def __init__(self, snapshot: State, replay: int) -> None:
        self.snapshot = snapshot
        self.base = replay
        self.batch: Iterator[Any] = iter(())
        self.batch_length = 0

    def state(self) -> State:
        consumed = self.base + self.batch_length - operator.length_hint(self.batch)
        return {"source": self.snapshot, "replay": consumed}


class _PrefetchRunner:
    """Starts and stops the worker and consumes its messages; holds no reference to the
    stage, so that garbage collection of the stage stops the worker at once."""

    def __init__(
        self,
        source: CheckpointableIterator[Any],
        slots: int,
        max_batch: int,
        snapshot_every: int,
        mode: str,
        start_method: str | None,
        warn_empty: bool,
        buffer_in_main_process: bool,
    ) -> None:
        self.source = source
        self.slots, self.max_batch, self.snapshot_every = slots, max_batch, snapshot_every
        self.mode, self.start_method, self.warn_empty = mode, start_method, warn_empty
        self.buffer_in_main_process = buffer_in_main_process
        self.channel: _workers.Channel | None = None
        self.cursor = _Cursor({}, 0)

    def stop(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.shutdown()

    def _start(self) -> _workers.Channel:
        name, slots, warn_empty = "PrefetchIterator", self.slots, self.warn_empty
        production = _workers.Production(
            self.source, self.cursor.base, self.snapshot_every, self.max_batch
        )
        channel: _workers.Channel
        if self.mode == "thread":
            channel = _workers.thread_channel(production, slots, name, warn_empty)
        elif self.buffer_in_main_process:  # a small pipe; the buffer is a thread's queue here
            process = _workers.ProcessChannel(
                production, min(2, slots), name, False, self.start_method
            )
            channel = _workers.buffered_channel(process, slots, name, warn_empty)
        else:
            channel = _workers.ProcessChannel(
                production, slots, name, warn_empty, self.start_method
            )
        self.channel = channel
        return channel

    def generate(self) -> Iterator[Any]:
        cursor = self.cursor
        channel = self._start()
        try:
            while True:
                kind, items, mark = channel.receive()
                if kind == _workers.END:
                    cursor.snapshot, cursor.base = items, 0
                    break
                if mark is not None:  # the snapshot is at items[offset]
                    snapshot, offset = mark
                    if offset:
                        cursor.batch, cursor.batch_length = iter(items[:offset]), offset
                        yield from cursor.batch
                    cursor.snapshot, cursor.base = snapshot, 0
                    items = items[offset:]
                cursor.batch, cursor.batch_length = iter(items), len(items)
                yield from cursor.batch
                cursor.base += cursor.batch_length
                cursor.batch_length = 0
        finally:
            if self.channel is channel:  # the source ended, failed, or the consumer is gone
                self.stop()


class PrefetchIterator(Stage[Any]):
    """Yields the items of its source, produced ahead by a background worker.

    The worker (a process by default, or a thread) iterates the source and keeps up to
    `buffer_size` items ready in a bounded queue, so that reading and decoding overlap
    with the consumer's work. The output is exactly the source's. The worker starts at
    the first ``next()`` and stops at ``close()``, when the iterator is garbage-collected,
    at interpreter exit, or when the source ends. Unlike infinibatch, prefetching is never
    silently skipped: it works under every start method or raises a clear error.

    Args:
        source_iterator: the source; it is reset.
        buffer_size: how many items may wait in the buffer (>= 1).
        buffer_in_main_process: with ``mode="process"``, keep the buffer in the
            consumer's process: a thread there (``infinibatch_like.PrefetchIterator.worker``)
            receives and unpickles the worker's items ahead of the consumer, so that
            ``next()`` finds them ready. Otherwise the buffer is the pipe from the worker
            and the consumer unpickles items as it takes them. No effect in thread mode.
        log_empty_buffer_warning: log a warning (``logging``, logger ``infinibatch_like``)
            whenever the consumer finds the buffer empty and has to wait.
        mode: ``"process"`` (a worker process: CPU-bound sources run in parallel; items
            are pickled) or ``"thread"`` (a worker thread: for I/O-bound sources or
            unpicklable items; shares the GIL).
        start_method: the multiprocessing start method of the worker process (``"fork"``,
            ``"forkserver"``, ``"spawn"``; None is the platform's default). Except under
            ``"fork"`` the source pipeline is pickled to the worker; a pipeline that cannot
            be pickled raises ``pickle.PicklingError`` naming the stage and callable.
        snapshot_every: the worker sends the source's state every `snapshot_every` items
            (>= 1); this bounds what a restore replays.

    Raises:
        ValueError: for ``buffer_size <= 0``, an unknown mode or start method.
        Exception: whatever the source raises, re-raised in the consumer at the position
            where it happened, with the worker's traceback as ``__cause__`` and a note
            naming the stage.
        WorkerError: (a RuntimeError) if the worker process dies.

    Checkpoint:
        ``{"source", "replay"}``: the source's state at the last snapshot at or before the
        consumer's position (taken by the worker every `snapshot_every` items) and the
        number of items consumed since (at most `snapshot_every`, except right after a
        restore). Size: one source state plus an int. A restore sets the source to the snapshot and
        skips `replay` items in the new worker: it re-reads at most `snapshot_every` items
        (plus whatever the source's own restore re-reads). Items in the buffer are not part
        of the state and are produced again after a restore.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"source": dict, "replay": int}

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        buffer_size: int,
        buffer_in_main_process: bool = False,
        log_empty_buffer_warning: bool = False,
        *,
        mode: str = "process",
        start_method: str | None = None,
        snapshot_every: int = 100,
    ) -> None:
        require_checkpointable("PrefetchIterator", "source_iterator", source_iterator)
        require_int("PrefetchIterator", "buffer_size", buffer_size, 1)
        require_int("PrefetchIterator", "snapshot_every", snapshot_every, 1)
        if mode not in _MODES:
            raise ValueError(f"PrefetchIterator: mode must be one of {_MODES}, got {mode!r}")
        if mode == "process":
            _workers.get_context("PrefetchIterator", start_method)
        self._source = source_iterator
        self._sources = (source_iterator,)
        # Batches small enough that the buffer holds several of them.
        max_batch = max(1, min(64, buffer_size // 4, snapshot_every))
        slots = max(1, -(-buffer_size // max_batch))
        self._runner = _PrefetchRunner(
            source_iterator,
            slots,
            max_batch,
            snapshot_every,
            mode,
            start_method,
            bool(log_empty_buffer_warning),
            bool(buffer_in_main_process),
        )
        self._finalizer = weakref.finalize(self, self._runner.stop)
        self._restore(None)

    def _state(self) -> State:
        return self._runner.cursor.state()

    def _restore(self, state: State | None) -> None:
        runner = self._runner
        runner.stop()
        self.restore_source(self._source, None if state is None else state["source"], "source")
        if state is None:
            runner.cursor = _Cursor(self._source.getstate(), 0)
        else:
            if state["replay"] < 0:
                raise self.mismatch(f"'replay' must be >= 0, got {state['replay']}")
            runner.cursor = _Cursor(state["source"], state["replay"])
        self._iterator = runner.generate()

    def close(self) -> None:
        """Stop the worker (and, through the source, any nested workers), then close the
        source. Idempotent; afterwards ``next()`` and ``setstate()`` raise RuntimeError."""
        if not self._closed:
            self._runner.stop()
        super().close()
