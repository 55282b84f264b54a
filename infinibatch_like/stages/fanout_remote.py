"""Fan-out consumers in other processes of the host: the owner serves them on a Unix
socket (`background.fanout_server.Server`), each attaches by its path (`attach`).

Messages are pickled tuples in the frames of `background.wire`, one request and one
reply at a time: ``("attach", index, pid)``, ``("ring", True)`` (this process mapped the
owner's ring of replies), ``("next", most, released)``, ``("getstate", held)``,
``("setstate", state)``, ``("close", held, released)`` (`held`: items received and not
used; `released`: the owner's shared-memory segments whose mappings this process
collected since it last said, which the owner may then reuse). A reply is ``("ok",
value)``, ``("end",)`` or ``("error", report)``; a ``"next"`` request is answered by
``("items", places)`` for k items (the last may be an end or an error): each item's
reply, pickled once by the owner for every consumer, lies at its place ``(offset,
length)`` in the ring (`background.shm_arena`), or follows as a frame (place None); its
large arrays and tensors are in shared memory that the consumer maps as it unpickles
them. The consumer reads every reply of an answer before its next request (the owner
reuses their places then). One thread of the owner answers every consumer; a consumer
waits for a reply while the owner process lives (an owner that dies or closes is seen at
once, by the end of the socket, or within `POLL_S` by its pid).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
import weakref
from collections import deque
from typing import Any, Generic, NoReturn, TypeVar

from .._core.checks import require_int
from .._core.protocol import State
from ..background import shm_arena, shm_broadcast, wire
from ..background.errors import WorkerError, as_exception
from ..background.fanout_hub import NAME
from ..background.fanout_server import SEND_TIMEOUT_S
from ..background.lifecycle import LAST_WORDS_S, POLL_S, parent_alive
from .fanout import FanOutStage

T = TypeVar("T")

_CONNECTIONS: weakref.WeakSet[_Connection] = weakref.WeakSet()


class _Connection:
    """A consumer's connection to the owner: one request and its reply at a time."""

    def __init__(self, address: str, index: int, timeout: float) -> None:
        self.address, self.index = address, index
        self.socket = _connect(address, timeout)
        self.reader = wire.FrameReader(self.socket.fileno())
        self.owner_pid = 0
        self.shared_prefix: str | None = None
        """The prefix of the names of the owner's shared-memory segments."""
        self.ring: memoryview | None = None
        """The owner's ring of replies, mapped (None: its replies come as frames)."""
        self.close = weakref.finalize(self, self.socket.close)
        _CONNECTIONS.add(self)

    def _owner_alive(self) -> bool:
        return self.owner_pid == 0 or parent_alive(self.owner_pid)

    def call(self, request: tuple[Any, ...]) -> Any:
        """Send `request`, return the owner's answer (raising its error)."""
        try:
            wire.send_frames(self.socket, request)
        except OSError:  # the connection was reset: the owner is gone
            self._lost()
        return self.opened(_unpickled(self._receive()))

    def map_ring(self, ring: tuple[str, int] | None) -> None:
        """Map the owner's ring of replies `ring` (name, capacity) and tell the owner, so
        that it sends where replies lie instead of their bytes (not if it cannot be
        mapped here: another /dev/shm)."""
        if ring is None:
            return
        try:
            self.ring = shm_arena.Ring.attach(*ring)
        except OSError:
            return
        self.call(("ring", True))

    def fetch(self, most: int) -> list[tuple[Any, ...]]:
        """The replies of this consumer's next item and of up to `most` - 1 more,
        unpickled (their shared memory mapped) before the next request."""
        places: list[tuple[int, int] | None] = self.call(("next", most, self.released()))
        ring = self.ring
        replies = [
            _unpickled(
                self._receive()
                if place is None or ring is None
                else ring[place[0] : place[0] + place[1]]
            )
            for place in places
        ]
        if any(reply[0] == "unreadable" for reply in replies) and not self._owner_alive():
            self._lost()  # received before it died, its segments gone with it
        return replies

    def _receive(self) -> bytearray:
        try:
            frame = wire.read_until(self.reader, self._owner_alive, POLL_S, LAST_WORDS_S)
        except OSError:  # the connection was reset: the owner is gone
            frame = None
        except BaseException:  # an interrupted exchange leaves the connection unusable
            self.close()
            raise
        if frame is None:
            self._lost()
        return frame

    def _lost(self) -> NoReturn:
        self.close()
        prefix = self.shared_prefix
        if prefix and not parent_alive(self.owner_pid):  # what it left in /dev/shm
            shm_broadcast.remove_left(prefix)
        raise WorkerError(
            f"{NAME}: the owner (pid {self.owner_pid or 'unknown'}) serving "
            f"{self.address} closed or died while consumer {self.index} waited for "
            "it; attach again to a new owner and setstate() from a checkpoint"
        )

    def released(self) -> list[str]:
        """The owner's segments whose mappings this process collected since it last said."""
        prefix = self.shared_prefix
        return [] if prefix is None else shm_broadcast.take_released(prefix)

    @staticmethod
    def opened(reply: tuple[Any, ...]) -> Any:
        """The value of a reply, or its error raised (StopIteration at the end)."""
        if reply[0] == "end":
            raise StopIteration
        if reply[0] == "error":
            raise as_exception(reply[1])
        if reply[0] == "unreadable":
            raise reply[1]
        return reply[1]

    def hang_up(self) -> None:
        """Close, once the owner has closed its end (its serving thread is done then)."""
        deadline = time.monotonic() + LAST_WORDS_S
        with contextlib.suppress(EOFError, OSError):
            while time.monotonic() < deadline:
                self.reader.read(POLL_S)
        self.close()


class _Remote:
    """The items of a remote consumer, fetched `prefetch` at a time at most."""

    def __init__(self, connection: _Connection, prefetch: int) -> None:
        self._fetch, self._opened, self._prefetch = connection.fetch, connection.opened, prefetch
        self._replies: deque[tuple[Any, ...]] = deque()

    def __iter__(self) -> _Remote:
        return self

    def __next__(self) -> Any:
        if not self._replies:
            self._replies.extend(self._fetch(self._prefetch))
        return self._opened(self._replies.popleft())

    def held(self) -> int:
        """Items received and not used yet (an end of stream received is not an item)."""
        return sum(reply[0] != "end" for reply in self._replies)


class RemoteConsumer(FanOutStage[T], Generic[T]):
    """A consumer of a `FanOut` served by another process of this host (see `attach`).

    Checkpoint:
        The whole fan-out's state, as for `FanOutConsumer` (asked of the owner).
    """

    def __init__(
        self, address: str, index: int, *, timeout: float = 60.0, prefetch: int = 1
    ) -> None:
        require_int(NAME, "prefetch", prefetch, 1)
        self._index, self._prefetch = index, prefetch
        self._connection = connection = _Connection(address, index, timeout)
        self._final: State | None = None
        try:
            self._count, self._mode, connection.owner_pid, connection.shared_prefix, ring = (
                connection.call(("attach", index, os.getpid()))
            )
            connection.map_ring(ring)
        except BaseException:  # refused: its socket is closed now, not when collected
            connection.close()
            raise
        self._iterator = _Remote(connection, prefetch)

    def _held(self) -> int:
        iterator = self._iterator
        return iterator.held() if isinstance(iterator, _Remote) else 0

    def _state(self) -> State:
        if self._final is not None:
            return self._final
        fields: State = self._connection.call(("getstate", self._held()))
        return fields

    def _restore(self, state: State | None) -> None:
        self._connection.call(("setstate", state))
        self._iterator = _Remote(self._connection, self._prefetch)

    def close(self) -> None:
        """Tell the owner this consumer is closed (it holds no one back any more), then
        close the connection. Idempotent."""
        connection = self._connection
        if not self._closed and connection.close.alive:
            with contextlib.suppress(Exception):  # an owner gone: getstate() will say so
                self._final = connection.call(("close", self._held(), connection.released()))
        super().close()
        connection.hang_up()


def _unpickled(frame: bytearray | memoryview) -> tuple[Any, ...]:
    """A reply unpickled; one that cannot be: ``("unreadable", error)``, the error raised
    at its item."""
    try:
        reply: tuple[Any, ...] = pickle.loads(frame)
    except Exception as error:
        return ("unreadable", error)
    return reply


def _connect(address: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError) as error:
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{NAME}: no fan-out serves at {address!r} (waited timeout={timeout} s: "
                    f"{error.strerror}); start its owner with FanOut.serve({address!r})"
                ) from None
            time.sleep(0.05)
            continue
        sock.settimeout(SEND_TIMEOUT_S)
        return sock


def attach(
    address: str, index: int, *, timeout: float = 60.0, prefetch: int = 1
) -> RemoteConsumer[Any]:
    """Consumer `index` of the fan-out served at `address` (`FanOut.serve`), from any
    process of this host; waits up to `timeout` seconds for the owner to serve.

    With `prefetch` > 1, each request to the owner brings up to that many items that are
    ready (fewer round trips). The consumer's own ``getstate()`` stays exact; in states
    taken by the owner or by other consumers, its position counts the items it received,
    up to ``prefetch - 1`` more than it used.

    Raises:
        TimeoutError: if nothing serves at `address` within `timeout`.
        ValueError: if the index is out of range or already attached.
    """
    return RemoteConsumer(address, index, timeout=timeout, prefetch=prefetch)


def _after_fork_in_child() -> None:
    for connection in list(_CONNECTIONS):
        connection.socket.close()  # in the child only: the parent's stays open
    _CONNECTIONS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
