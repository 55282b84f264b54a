"""`RangeReader`: a remote object's bytes, fetched as consecutive byte ranges, several at
once in threads, and delivered in order as one stream.

Each range is one request (``fetch(start, end)``), retried on its own by the retry policy;
the ranges partition the object, so no byte is fetched twice but by a retry. At most
`in_flight` ranges are being fetched or wait to be read, besides the one being read. The
threads (named ``infinibatch_like.io.ranges``) hold no reference to the reader: a reader
dropped without `close` is collected, and its finalizer stops them, as `close` does. With
a `cancel` (a `LoopFetch`'s), stopping cancels the requests in flight, so that the threads
have ended when `close` returns, whatever the server's speed; without one, each thread
finishes the request it is in (waited for up to `JOIN_S`).
"""

from __future__ import annotations

import io
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from .._core.notes import add_note
from ..background.lifecycle import JOIN_S, POLL_S, check_interrupt
from ._counts import count
from .errors import ChunkReadError
from .retry import RetryPolicy, call_with_retries

Fetch = Callable[[int, int], bytes]
"""``fetch(start, end)``: the object's bytes ``[start, end)``, in one request."""
THREAD_NAME = "infinibatch_like.io.ranges"


class Sink(Protocol):
    """Where the bytes go as the reader takes them (the local cache's writer)."""

    def write(self, data: bytes) -> None: ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...


class _Range:
    """One range: ``[start, end)``, and, once `done`, its bytes or its error."""

    __slots__ = ("data", "done", "end", "error", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.done = threading.Event()
        self.data = b""
        self.error: BaseException | None = None


def fetch_range(
    fetch: Fetch,
    ref: str,
    policy: RetryPolicy | None,
    stop: threading.Event | None,
    expired: Callable[[BaseException], ChunkReadError | None],
    start: int,
    end: int,
) -> bytes:
    """Bytes ``[start, end)`` of `ref`, retried by `policy`; `expired` turns an error that
    says the object changed into the error to raise (or None)."""

    def once() -> bytes:
        count("requests")
        try:
            data = fetch(start, end)
        except Exception as error:
            changed = expired(error)
            if changed is not None:
                raise changed from error
            raise
        count("bytes", len(data))
        return data

    data = call_with_retries(once, ref, f"reading bytes {start}-{end - 1} of", policy, stop)
    if len(data) != end - start:
        raise ChunkReadError(
            f"{ref} changed while it was being read: bytes {start}-{end - 1} came back as "
            f"{len(data)} bytes (it is no longer as long as it was); read it again from its "
            "start"
        )
    return data


def _fill(fetch_one: Callable[[int, int], bytes], stop: threading.Event, task: _Range) -> None:
    try:
        if not stop.is_set():
            task.data = fetch_one(task.start, task.end)
    except BaseException as error:
        task.error = error
    finally:
        task.done.set()


def _work(tasks: queue.SimpleQueue[_Range | None], run: Callable[[_Range], None]) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        run(task)


def _shut_down(
    stop: threading.Event,
    tasks: queue.SimpleQueue[_Range | None],
    threads: list[threading.Thread],
    sink: Sink | None,
    release: Callable[[], None] | None,
    cancel: Callable[[], None] | None,
) -> None:
    """Stop the threads (cancelling their requests, or letting them finish the request they
    are in), drop an unfinished cache entry, release the remote file."""
    stop.set()
    if cancel is not None:
        cancel()
    for _ in threads:
        tasks.put(None)
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(JOIN_S)
    threads.clear()
    try:
        if sink is not None:
            sink.discard()
    finally:
        if release is not None:
            release()


class RangeReader(io.RawIOBase):
    """The `size` bytes of `ref`, fetched by `fetch` in ranges of `range_size` bytes,
    `in_flight` at once in threads (0: one at a time, in the reading thread).

    Args:
        fetch: fetches ``[start, end)`` in one request (thread-safe).
        ref: the object, for errors.
        size: its size.
        range_size: bytes per range.
        in_flight: ranges fetched ahead at once.
        policy: the retry policy of each range.
        expired: maps an error of `fetch` meaning "the object changed" to the error to
            raise; None for other errors.
        sink: receives each range as it is taken, in order; committed after the last one,
            discarded if the reader is closed before.
        release: called once, when the reader is closed or collected.
        cancel: cancels the requests of `fetch` in flight, and refuses new ones (called
            when the reader is closed or collected); None: they are waited for.
    """

    def __init__(
        self,
        fetch: Fetch,
        ref: str,
        size: int,
        *,
        range_size: int,
        in_flight: int,
        policy: RetryPolicy | None,
        expired: Callable[[BaseException], ChunkReadError | None],
        sink: Sink | None = None,
        release: Callable[[], None] | None = None,
        cancel: Callable[[], None] | None = None,
    ) -> None:
        self._ref, self._size, self._range_size = ref, size, range_size
        self._in_flight, self._sink = in_flight, sink
        self._next_start = 0  # of the next range to submit (or fetch)
        self._pending: deque[_Range] = deque()
        self._current = memoryview(b"")
        self._failure: BaseException | None = None
        self._stop = threading.Event()
        self._fetch_one = partial(fetch_range, fetch, ref, policy, self._stop, expired)
        self._tasks: queue.SimpleQueue[_Range | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(
            self, _shut_down, self._stop, self._tasks, self._threads, sink, release, cancel
        )

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._failure is not None:
            raise self._failure
        if self.closed:
            raise self._closed_error()
        while not self._current:
            if self._next_start >= self._size and not self._pending:
                self._commit()  # an empty object: there was no range to take
                return 0
            try:
                self._current = memoryview(self._take())
            except BaseException as error:
                self._failure = error
                raise
        view = memoryview(buffer).cast("B")
        size = min(len(view), len(self._current))
        view[:size] = self._current[:size]
        self._current = self._current[size:]
        return size

    def _take(self) -> bytes:
        """The next range's bytes (passed to the sink, which is committed after the last)."""
        if self._in_flight == 0:
            start = self._next_start
            self._next_start = end = min(start + self._range_size, self._size)
            data = self._fetch_one(start, end)
        else:
            data = self._take_fetched()
        if self._sink is not None:
            self._sink.write(data)
            if self._next_start >= self._size and not self._pending:
                self._commit()
        return data

    def _commit(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.commit()

    def _take_fetched(self) -> bytes:
        if os.getpid() != self._pid:  # its threads did not come along: never wait for them
            raise ChunkReadError(
                f"{self._ref}: this stream was opened in process {self._pid} and cannot be "
                "read in a forked child; open the chunk again in this process"
            )
        self._submit()
        if not self._pending:  # closed meanwhile, by another thread
            raise self._closed_error()
        task = self._pending.popleft()
        while not task.done.wait(POLL_S):
            check_interrupt()
        self._submit()
        if task.error is not None:
            error = task.error
            add_note(
                error,
                f"(raised in the thread {THREAD_NAME} fetching bytes "
                f"{task.start}-{task.end - 1} of {self._ref})",
            )
            raise error
        return task.data

    def _closed_error(self) -> ValueError:
        return ValueError(f"{self._ref}: read from a closed stream")

    def _submit(self) -> None:
        """Hand ranges to the threads until `in_flight` are pending (threads start on the
        first call, as many as there are ranges to fetch at once); none once stopped (by a
        `close` in another thread, which this one waited on)."""
        if self._stop.is_set():
            return
        if not self._threads:
            ranges = -(-self._size // self._range_size)
            run = partial(_fill, self._fetch_one, self._stop)
            for _ in range(min(self._in_flight, ranges)):
                thread = threading.Thread(
                    target=_work, args=(self._tasks, run), name=THREAD_NAME, daemon=True
                )
                thread.start()
                self._threads.append(thread)
        while len(self._pending) < self._in_flight and self._next_start < self._size:
            start = self._next_start
            self._next_start = end = min(start + self._range_size, self._size)
            task = _Range(start, end)
            self._pending.append(task)
            self._tasks.put(task)

    def close(self) -> None:
        """Stop the threads (cancelling their requests if it can), drop what is buffered."""
        if self.closed:
            return
        try:
            self._finalizer()
        finally:
            self._pending.clear()
            self._current = memoryview(b"")
            super().close()
