"""Prefetching: produce a source's items ahead of the consumer, in a thread or a process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._core.checks import require_checkpointable, require_int
from .._core.probe import Gauges, absorb_delta, probing
from .._core.protocol import CheckpointableIterator
from ..background.channels import (
    Channel,
    ProcessChannel,
    Production,
    buffered_channel,
    thread_channel,
)
from ..background.lifecycle import ProcessesRefused, get_context, warn_thread_fallback
from ..background.messages import End
from ..background.stage import BackgroundStage, Runner
from ..io._counts import add_worker_reads

_MODES = ("process", "thread")


class _PrefetchRunner(Runner):
    """One producer worker (a `Channel`) over the source, from the cursor's position."""

    def __init__(
        self,
        source: CheckpointableIterator[Any],
        snapshot_every: int,
        buffer_size: int,
        mode: str,
        start_method: str | None,
        warn_empty: bool,
        buffer_in_main_process: bool,
    ) -> None:
        super().__init__(source, snapshot_every)
        self.buffer_size = buffer_size
        self.started_at = 0
        """The cursor's position when the worker started (it produces from there)."""
        # Batches small enough that the buffer holds several of them.
        self.max_batch = max(1, min(64, buffer_size // 4, snapshot_every))
        self.slots = max(1, -(-buffer_size // self.max_batch))
        self.mode, self.start_method, self.warn_empty = mode, start_method, warn_empty
        self.buffer_in_main_process = buffer_in_main_process
        self.channel: Channel | None = None
        self.sources_in_worker_process = mode == "process"
        self.pulls_source_in = "process" if mode == "process" else "thread"

    def _start(self) -> None:
        self.started_at = self.cursor.consumed
        production = Production(
            self.source,
            self.cursor.consumed,
            self.snapshot_every,
            self.max_batch,
            "PrefetchIterator",
            probing(self.source) if self.mode == "process" else 0,
        )
        if self.mode == "process":
            try:
                self.channel = self._process_channel(production)
                return
            except ProcessesRefused as error:
                warn_thread_fallback("PrefetchIterator", error)
        self.channel = thread_channel(production, self.slots, self.warn_empty)

    def _process_channel(self, production: Production) -> Channel:
        if self.buffer_in_main_process:  # a small buffer there, the real one here
            process = ProcessChannel(
                production, min(2 * self.max_batch, self.buffer_size), False, self.start_method
            )
            return buffered_channel(process, self.slots, self.warn_empty)
        return ProcessChannel(production, self.buffer_size, self.warn_empty, self.start_method)

    def _gauges(self) -> Gauges:
        """Items in flight: produced by the worker and not yet taken by the consumer (in
        its buffer: a worker process's outbox and pipe included; the rest of the batch
        being taken); the fill: those over `buffer_size` (at most 1)."""
        channel = self.channel
        if channel is None:  # the source ended (or failed): nothing waits
            return Gauges(0.0, 0)
        produced = channel.produced()
        if produced is None:  # a worker thread: what waits in the queue
            in_flight = channel.waiting() + self.cursor.unserved()
        else:
            in_flight = produced - (self.cursor.position() - self.started_at)
        return Gauges(min(1.0, in_flight / self.buffer_size), in_flight)

    def stop(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.shutdown()

    def generate(self) -> Iterator[Any]:
        self.start()
        channel, cursor = self.channel, self.cursor
        assert channel is not None
        try:
            while True:
                message = channel.receive()
                if message.stats is not None:  # from a worker process, now and then
                    absorb_delta(self.source, message.stats)
                if message.reads:
                    add_worker_reads(message.reads)
                if isinstance(message, End):
                    cursor.snapshot(cursor.consumed, message.state)
                    return
                yield from cursor.serve(message.items, message.mark)
                cursor.served()
        finally:
            if self.channel is channel:  # the source ended, failed, or the consumer is gone
                self.stop()


class PrefetchIterator(BackgroundStage[Any]):
    """Yields the items of its source, produced ahead by a background worker.

    The worker (a process by default, or a thread) iterates the source and keeps up to
    `buffer_size` items ready in a bounded queue, so that reading and decoding overlap
    with the consumer's work. The output is exactly the source's, up to and including an
    error of the source (the items before it are all delivered). The worker starts at
    the first ``next()`` (or at `start`) and stops at ``close()``, when the iterator is
    garbage-collected, at interpreter exit, when the source ends, or when the consumer's
    process dies (also inside a DataLoader worker). Unlike infinibatch, prefetching is
    never silently skipped: it works under every start method or raises a clear error.

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
            ``"fork"`` the source pipeline is pickled to the worker, with cloudpickle
            (``pip install infinibatch_like[parallel]``) where it holds lambdas or local
            functions; what cannot be sent (an open file, a lock) raises
            ``pickle.PicklingError`` naming the stage and the object.
        snapshot_every: the worker sends the source's state every `snapshot_every` items
            (>= 1); this bounds what a restore replays.

    Raises:
        ValueError: for ``buffer_size <= 0``, an unknown mode or start method.
        Exception: whatever the source raises, re-raised in the consumer at the position
            where it happened, with the worker's traceback as ``__cause__`` and a note
            naming the stage; ``getstate()`` then points at the failing item. An item that
            the worker process cannot pickle fails the same way, at its position.
        WorkerError: (a RuntimeError) if the worker process dies, within a second or so,
            whatever it was doing.

    Checkpoint:
        ``{"source", "replay"}``: the source's state at the last snapshot at or before the
        consumer's position (taken by the worker every `snapshot_every` items) and the
        number of items consumed since (at most `snapshot_every`, also after restores: the
        worker takes a snapshot right after replaying; a state with more is refused).
        Size: one source state plus an int. A restore sets the source to the snapshot and
        skips `replay` items in the new worker: it re-reads at most `snapshot_every` items
        (plus whatever the source's own restore re-reads). Items in the buffer are not part
        of the state and are produced again after a restore.
    """

    _not_elastic = "its replay counts items of this rank's stream"

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
            get_context("PrefetchIterator", start_method)
        runner = _PrefetchRunner(
            source_iterator,
            snapshot_every,
            buffer_size,
            mode,
            start_method,
            bool(log_empty_buffer_warning),
            bool(buffer_in_main_process),
        )
        self._init_background(source_iterator, runner)
        self._restore(None)
