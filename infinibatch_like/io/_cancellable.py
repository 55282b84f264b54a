"""`LoopFetch`: range requests that a closing reader cancels rather than waits for.

An fsspec async file system (s3fs) runs its requests on an event loop in a thread of its
own; a blocking call waits for them there, and a thread waiting for one cannot be stopped
before the server has sent the whole answer, however slowly. `LoopFetch` runs each request
as a task on that loop and waits for the task; `cancel` cancels the tasks in flight and
refuses new ones. A cancelled request ends at its next await, closing its connection (an
answer not read to its end is never put back in the pool), and the waiting thread returns
once the task has ended.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from ..background.lifecycle import POLL_S, check_interrupt

Request = Callable[[int, int], Coroutine[Any, Any, bytes]]
"""``request(start, end)``: a coroutine fetching the bytes ``[start, end)``."""


class RequestCancelled(Exception):
    """A request cancelled by `LoopFetch.cancel` (its reader was closed)."""


class _Call:
    """One request on the loop: its task, and once `ended`, its bytes or its error."""

    def __init__(self, coroutine: Coroutine[Any, Any, bytes]) -> None:
        self.coroutine = coroutine
        self.task: asyncio.Task[bytes] | None = None
        self.ended = threading.Event()
        self.data = b""
        self.error: BaseException | None = None

    def start(self) -> None:  # on the loop
        self.task = asyncio.ensure_future(self.coroutine)
        self.task.add_done_callback(self._settle)

    def cancel(self) -> None:  # on the loop, after `start`
        if self.task is not None:
            self.task.cancel()

    def _settle(self, task: asyncio.Task[bytes]) -> None:  # on the loop
        if task.cancelled():
            self.error = RequestCancelled("the request was cancelled: its reader was closed")
        else:
            self.error = task.exception()
            if self.error is None:
                self.data = task.result()
        self.ended.set()


class LoopFetch:
    """``fetch(start, end)`` (thread-safe): ``request(start, end)`` run on `loop`, an event
    loop running in another thread, while the calling thread waits; `cancel` ends the
    requests in flight at once and makes later ones raise `RequestCancelled`. In a forked
    child, where no thread runs the loop, a request fails at once (RuntimeError)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: Request) -> None:
        self._loop, self._request = loop, request
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        self._cancelled = False

    def __call__(self, start: int, end: int) -> bytes:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"its event loop runs in process {self._pid}, not in this forked child: "
                "open the object again in this process"
            )
        call = _Call(self._request(start, end))
        with self._lock:  # started before `cancel` can see it: the loop runs them in order
            if self._cancelled:
                call.coroutine.close()
                raise RequestCancelled("the request was cancelled: its reader was closed")
            try:
                self._loop.call_soon_threadsafe(call.start)
            except BaseException:  # the loop is closed
                call.coroutine.close()
                raise
            self._calls.add(call)
        try:
            while not call.ended.wait(POLL_S):
                check_interrupt()
                if self._loop.is_closed():  # the request will never run, nor end
                    raise RuntimeError("its event loop was closed during the request")
        except BaseException:  # interrupted: the request is of no use any more
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(call.cancel)
            elif call.task is None:  # never started, and never will be
                call.coroutine.close()
            raise
        finally:
            with self._lock:
                self._calls.discard(call)
        if call.error is not None:
            raise call.error
        return call.data

    def cancel(self) -> None:
        """Cancel the requests in flight (their threads return once each has ended) and
        refuse new ones."""
        if os.getpid() != self._pid:  # a forked child's copy: the requests are the parent's
            return
        with self._lock:
            self._cancelled = True
            for call in self._calls:
                self._loop.call_soon_threadsafe(call.cancel)
