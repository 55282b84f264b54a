"""Chunk readers: collections (a chunk's records) read into lists by threads of the
consumer's process, ahead of the consumer (a `SelectManyIterator`'s ``read_ahead``).

zlib, file and network reads release the GIL, so reading and decompressing the next
chunks overlaps with the consumer's work. One daemon thread per collection, named
``infinibatch_like.<stage>.reader``; the consumer waits for one with `wait_for`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain, repeat
from typing import Any

from .._core.probe import Gauges, StageProbe
from .._core.protocol import SkippableIterator, State
from .lifecycle import wait_for


def _raising(error: BaseException) -> Iterator[Any]:
    """An iterator that raises `error` when it is first advanced."""
    yield from ()
    raise error


class ChunkRead:
    """``read()`` (opening a collection: a chunk's reader) drained into a list by a daemon
    thread of `owner`; `result` waits for it. The items read before an error are kept
    and yielded before it; an error of ``read()`` itself (opening the chunk) is raised by
    `result`. The first `skip` items (those a restore passes over) are skipped in the
    thread where the collection is a `SkippableIterator`. If `timed`, the thread's busy
    time is measured."""

    def __init__(
        self, owner: str, read: Callable[[], Iterator[Any]], skip: int = 0, timed: bool = False
    ) -> None:
        self._read, self._skip, self._skipped = read, skip, 0
        self._items: list[Any] = []
        self._error: BaseException | None = None
        self._opened = False
        self._timed = timed
        self._started = self._finished = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"infinibatch_like.{owner}.reader", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        if self._timed:
            self._started = time.perf_counter()
        try:
            inner = self._read()
            self._opened = True
            if self._skip and isinstance(inner, SkippableIterator):  # not read: skipped
                self._skipped = inner.skip(self._skip)
            self._items.extend(inner)
        except BaseException as error:
            self._error = error
        finally:
            if self._timed:
                self._finished = time.perf_counter()

    def reading(self) -> bool:
        """Whether its thread is still reading."""
        return self._thread.is_alive()

    def busy_s(self, now: float) -> float:
        """Seconds its thread has read so far (until `now` while reading; 0 if not timed)."""
        started, finished = self._started, self._finished
        return 0.0 if not started else (finished or now) - started

    def _joined(self, timeout: float) -> bool | None:
        self._thread.join(timeout)
        return None if self._thread.is_alive() else True

    def result(self) -> Iterator[Any]:
        """The collection's items, once read (a pending interrupt is raised meanwhile)."""
        wait_for(self._joined, self._thread.is_alive)
        items: Iterator[Any] = iter(self._items)
        if self._skipped:  # stand-ins for the items skipped in the thread, which the
            items = chain(repeat(None, self._skipped), items)  # consumer skips again
        if self._error is None:
            return items
        error, self._error = self._error, None
        if not self._opened:
            raise error
        return chain(items, _raising(error))

    def wait(self) -> None:
        self._thread.join()


class ReadAhead:
    """The collections that a stage reads ahead: `pending` (read or being read, in order,
    each with the source's state before its item and the item) and `current` (the one
    being yielded, perhaps still being read). Statistics read its gauges; a read's busy
    time goes into `probe` once it is done."""

    def __init__(self, capacity: int, probe: StageProbe | None) -> None:
        self.pending: deque[tuple[State, Any, ChunkRead]] = deque()
        self.current: ChunkRead | None = None
        self._capacity, self._probe = capacity, probe

    def advance(self, read: ChunkRead | None) -> None:
        """`read` (popped from `pending`) becomes the current one; the previous is done."""
        done, self.current = self.current, read
        if done is not None and self._probe is not None:
            self._probe.worker_busy_s += done.busy_s(time.perf_counter())

    def close(self) -> None:
        """Wait for the reads in flight (no reader thread outlives its stage's iteration),
        counting their time."""
        for _, _, read in self.pending:
            read.wait()
        while self.pending:
            self.advance(self.pending.popleft()[2])
        self.advance(None)

    def gauges(self) -> Gauges:
        """Collections read and waiting over the read-ahead, those being read (the current
        one included), the most reader threads at once (those ahead and the current one),
        the readers' busy time on collections not yet done."""
        now = time.perf_counter()
        reads = [read for _, _, read in list(self.pending)]
        ready = sum(not read.reading() for read in reads)
        current = self.current
        if current is not None:
            reads.append(current)
        in_flight = sum(read.reading() for read in reads)
        busy = sum(read.busy_s(now) for read in reads)
        return Gauges(ready / self._capacity, in_flight, self._capacity + 1, busy, "chunks")
