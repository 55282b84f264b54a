"""How objects and bytes cross a process boundary.

Pipelines and transforms go to a worker process with plain ``pickle`` where it works, else
with ``cloudpickle`` (the ``parallel`` extra), which also sends lambdas and local
functions by value. Messages are plain ``pickle`` bytes (protocol 5) in length-prefixed
frames on a pipe: the reader polls the pipe itself and reads what is there without
blocking, so a writer that dies half-way through a large message never hangs it. This
also bypasses the reductions that ``torch.multiprocessing`` installs into
multiprocessing's pickler (shared memory through file descriptors): no descriptor is
sent and no semaphore is ever created. Large numpy arrays and CPU tensors in the
messages of worker processes go through the library's own shared memory instead
(`shm`: one copy, by the worker). `send_frames` writes frames to a socket (a fan-out's
consumers in other processes).
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from .._core.pickling import callable_pickling
from .lifecycle import wait_for

PROTOCOL = pickle.HIGHEST_PROTOCOL

_HEADER = 8
"""Bytes of a frame's length prefix (little-endian unsigned)."""


def dumps_for_worker(owner: str, what: str, value: object, method: str) -> bytes:
    """Pickle `value` (part of `owner`'s pipeline) for a worker started by `method`,
    with cloudpickle where plain pickle fails; or raise a PicklingError naming it."""
    try:
        return pickle.dumps(value, PROTOCOL)
    except Exception as error:
        first: Exception = error
    try:
        import cloudpickle
    except ImportError:
        raise pickle.PicklingError(
            f"{owner}: cannot send its {what} to a worker process started with {method!r} "
            f"({type(first).__name__}: {first}). Lambdas and local functions need "
            "cloudpickle: pip install 'infinibatch_like[parallel]'; or use start_method='fork' "
            "or mode='thread'"
        ) from first
    try:
        with callable_pickling(cloudpickle.dumps):
            data: bytes = cloudpickle.dumps(value, PROTOCOL)
        return data
    except Exception as error:
        raise pickle.PicklingError(
            f"{owner}: cannot send its {what} to a worker process started with {method!r} "
            f"({type(error).__name__}: {error}): open files, locks, running generators and "
            "the like cannot be sent; create them inside the worker (e.g. in read_chunk_fn), "
            "or use start_method='fork' or mode='thread'"
        ) from error


def first_unpicklable(values: list[object]) -> tuple[int, Exception] | None:
    """The index of the first of `values` that plain pickle cannot send, and its error;
    None if each can be sent (used after a whole message failed to pickle)."""
    for index, value in enumerate(values):
        try:
            pickle.dumps(value, PROTOCOL)
        except Exception as error:
            return index, error
    return None


def write_frame(fd: int, data: bytes) -> None:
    """Write `data` as one frame to the (blocking) pipe `fd`."""
    view = memoryview(len(data).to_bytes(_HEADER, "little") + data)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Reads frames from a pipe without ever blocking on it: `read` returns a frame, or
    None if none is complete within `timeout`; EOFError when every writer closed the pipe.
    A frame written in pieces is assembled across calls; the system call that reads a
    body also reads the next frame's length, if it is there (one call a frame, not two,
    when frames queue up)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._header = bytearray(_HEADER)
        self._header_filled = 0
        self._body: bytearray | None = None
        self._body_filled = 0

    def _readv(self, buffers: list[memoryview]) -> int:
        """Bytes read into `buffers` (0: none there yet); EOFError at the pipe's end."""
        try:
            count = os.readv(self.fd, buffers)
        except BlockingIOError:
            return 0
        if count == 0:
            raise EOFError("the worker closed its end of the pipe")
        return count

    def read_ready(self) -> bytearray | None:
        """Read what the pipe holds of the current frame; the frame once complete (None:
        not yet)."""
        while True:
            body = self._body
            if body is None:
                if self._header_filled < _HEADER:
                    count = self._readv([memoryview(self._header)[self._header_filled :]])
                    if not count:
                        return None
                    self._header_filled += count
                    continue
                self._body = bytearray(int.from_bytes(self._header, "little"))
                self._body_filled = self._header_filled = 0
                continue
            if self._body_filled < len(body):
                views = [memoryview(body)[self._body_filled :], memoryview(self._header)]
                count = self._readv(views)
                if not count:
                    return None
                into_body = min(count, len(views[0]))
                self._body_filled += into_body
                self._header_filled = count - into_body
                if self._body_filled < len(body):
                    continue
            self._body = None
            return body

    def read(self, timeout: float) -> bytearray | None:
        """The next frame, waiting up to `timeout` seconds for it to complete."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self.read_ready()
            if frame is not None:
                return frame
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(1000 * left):
                return None


def read_until(
    reader: FrameReader, alive: Callable[[], bool], poll_s: float, last_words_s: float
) -> bytearray | None:
    """The next frame of `reader`, waiting while `alive()` (see `lifecycle.wait_for`): None
    once the writer is gone and nothing complete came within `last_words_s`."""
    try:
        return wait_for(reader.read, alive, last_words_s, poll_s)
    except EOFError:
        return None


def frames(*messages: tuple[Any, ...] | bytes) -> list[memoryview]:
    """The buffers of `messages` (tuples, or tuples already pickled) as frames, for
    `send_some`, without copying them into one buffer."""
    parts: list[memoryview] = []
    for message in messages:
        data = message if isinstance(message, bytes) else pickle.dumps(message, PROTOCOL)
        parts += [memoryview(len(data).to_bytes(_HEADER, "little")), memoryview(data)]
    return parts


def send_some(sock: socket.socket, parts: list[memoryview]) -> list[memoryview]:
    """Send what the socket takes of `parts` (all of it, if it blocks), in as few system
    calls as it takes; what is left (a non-blocking socket that is full)."""
    while parts:
        try:
            sent = sock.sendmsg(parts[:_MOST_PARTS])
        except BlockingIOError:
            break
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:
            parts[0] = parts[0][sent:]
    return parts


def send_frames(sock: socket.socket, *messages: tuple[Any, ...] | bytes) -> None:
    """Send `messages` (tuples, or tuples already pickled) as frames on a blocking socket."""
    send_some(sock, frames(*messages))


_MOST_PARTS = 64
"""Buffers per ``sendmsg`` call (well under the system's limit, IOV_MAX)."""
