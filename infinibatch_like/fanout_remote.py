"""Fan-out consumers in other processes of the host: the owner serves them on a Unix
socket (`Server`), each attaches by its path (`attach`).

Messages are pickled tuples in the frames of `_background.wire`, one request and one
reply at a time: ``("attach", index, pid)``, ``("next",)``, ``("getstate",)``,
``("setstate", state)``, ``("close",)``. A reply is ``("ok", value)``, ``("end",)`` or
``("error", report)``. The owner answers each consumer in a thread of its own; a consumer
waits for a reply while the owner process lives (an owner that dies or closes is seen at
once, by the end of the socket, or within `POLL_S` by its pid).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any, Generic, NoReturn, TypeVar

from ._background import wire
from ._background.errors import WorkerError, as_exception, report_error
from ._background.lifecycle import (
    LAST_WORDS_S,
    POLL_S,
    THREAD_STOP_S,
    Resource,
    check_interrupt,
    parent_alive,
)
from ._base import State, require_int
from ._fanout_hub import NAME, Hub
from .fanout import FanOutStage

T = TypeVar("T")

SEND_TIMEOUT_S = 60.0
"""How long sending one message may block on a peer that does not read (seconds)."""

_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()
_CONNECTIONS: weakref.WeakSet[_Connection] = weakref.WeakSet()


def _send(sock: socket.socket, *messages: tuple[Any, ...] | bytes) -> None:
    """Send `messages` (tuples, or tuples already pickled) as frames, in as few system
    calls as the socket takes, without copying them into one buffer."""
    parts: list[memoryview] = []
    for message in messages:
        data = message if isinstance(message, bytes) else pickle.dumps(message, wire.PROTOCOL)
        parts += [memoryview(len(data).to_bytes(8, "little")), memoryview(data)]
    while parts:
        sent = sock.sendmsg(parts[:_MOST_PARTS])
        while parts and sent >= len(parts[0]):
            sent -= len(parts.pop(0))
        if sent:
            parts[0] = parts[0][sent:]


_MOST_PARTS = 64
"""Buffers per ``sendmsg`` call (well under the system's limit, IOV_MAX)."""


def _gone(sock: socket.socket) -> bool:
    """Whether the peer of `sock` closed it (it sends nothing while it waits for a reply)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP)
    if not poller.poll(0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Server(Resource):
    """Serves the consumers of `hub` to processes that attach at `address`."""

    def __init__(self, hub: Hub, address: str) -> None:
        self.hub, self.address = hub, address
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
        except OSError as error:
            listener.close()
            raise ValueError(
                f"{NAME}.serve: cannot create the socket {address!r} ({error}); give a path "
                "in an existing directory, where no file is"
            ) from error
        os.chmod(address, 0o600)
        listener.listen()
        listener.settimeout(POLL_S)
        super().__init__()
        self._listener = listener
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._replies: dict[int, bytes] = {}
        self._serving = threading.local()
        self._accepter = self._thread(self._accept, "accept")
        _SERVERS.add(self)

    def _thread(self, target: Any, name: str, *args: Any) -> threading.Thread:
        thread = threading.Thread(
            target=target, args=args, name=f"infinibatch_like.{NAME}.{name}", daemon=True
        )
        thread.start()
        return thread

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was closed: stopping
                return
            connection.settimeout(SEND_TIMEOUT_S)
            with self._lock:
                self._connections.add(connection)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(self._thread(self._serve, "connection", connection))

    def _serve(self, connection: socket.socket) -> None:
        self._serving.connection = connection
        index: int | None = None
        closed = False
        try:
            reader = wire.FrameReader(connection.fileno())
            frame = self._receive(reader)
            if frame is None:
                return
            _, wanted, pid = pickle.loads(frame)
            try:
                self.hub.claim(wanted, f"attached by process {pid}")
            except (TypeError, ValueError) as error:
                _send(connection, ("error", report_error(error, self._where())))
                return
            index = wanted
            self.hub.connected(index, True)
            _send(connection, ("ok", (self.hub.consumers, self.hub.mode, os.getpid())))
            while (frame := self._receive(reader)) is not None:
                request = pickle.loads(frame)
                reply = self._answer(index, request, connection)
                closed = request[0] == "close"
                if isinstance(reply, list):  # items: their count, then each
                    _send(connection, ("items", len(reply)), *reply)
                else:
                    _send(connection, reply)
                if closed:
                    return
        except OSError:  # the consumer went away mid-message
            pass
        finally:
            if index is not None:
                self.hub.release(index)
                if closed:
                    self.hub.close_if_done()
                else:
                    self.hub.connected(index, False)
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _receive(self, reader: wire.FrameReader) -> bytearray | None:
        return wire.read_until(reader, lambda: not self._stop.is_set(), POLL_S, 0.0)

    def _where(self) -> str:
        return f"in the {NAME} owner (pid {os.getpid()}, serving {self.address})"

    def _answer(
        self, index: int, request: tuple[Any, ...], connection: socket.socket
    ) -> tuple[Any, ...] | list[Any]:
        hub = self.hub
        try:
            kind = request[0]
            if kind == "next":
                return self._items(index, request[1], connection)
            if kind == "getstate":
                return ("ok", hub.state(index, request[1]))
            if kind == "setstate":
                hub.restore_one(index, request[1])
                return ("ok", None)
            state = hub.state(index, request[1])  # the position a restore continues from
            hub.close_consumer(index)
            return ("ok", state)
        except StopIteration:
            return ("end",)
        except BaseException as error:  # re-raised in the consumer
            return ("error", report_error(error, self._where(), hub.source))

    def _items(self, index: int, most: int, connection: socket.socket) -> list[Any]:
        """Consumer `index`'s next item, waiting for it, and up to `most` - 1 more that
        need no wait: each the reply of one item (what `_Connection.fetch` reads)."""
        hub = self.hub
        replies: list[Any] = []
        hub.lend(index, most)  # until it is known how many it holds
        try:
            first = hub.take_at(index, lambda: _gone(connection))
            assert first is not None
            replies.append(self._pickled(*first))
            while len(replies) < most and isinstance(replies[-1], bytes):
                following = hub.take_at(index, wait=False)
                if following is None:
                    break
                replies.append(self._pickled(*following))
        except StopIteration:
            replies.append(("end",))
        except BaseException as error:  # re-raised in the consumer at its item
            replies.append(("error", report_error(error, self._where(), hub.source)))
        finally:
            hub.lend(index, len(replies))
        return replies

    def _pickled(self, position: int, item: Any) -> tuple[Any, ...] | bytes:
        """The reply for the item at upstream `position`, pickled once for every consumer
        (kept while a consumer may still take it)."""
        with self._lock:
            data = self._replies.get(position)
        if data is None:
            try:
                data = pickle.dumps(("ok", item), wire.PROTOCOL)
            except Exception as error:
                return ("error", report_error(error, f"pickling an item {self._where()}"))
            with self._lock:
                self._replies[position] = data
                oldest = self.hub.base
                for stale in [key for key in self._replies if key < oldest]:
                    del self._replies[stale]
        return data

    def _shutdown(self) -> None:
        self._stop.set()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        with self._lock:
            connections = list(self._connections)
        own = getattr(self._serving, "connection", None)  # closed last, by its thread
        for connection in connections:  # the consumers see the end of their socket
            if connection is not own:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        self.join()

    def join(self) -> None:
        """Wait until the threads serving the consumers are gone (not this one, if it is
        one: the last consumer to close stops the server)."""
        with self._lock:
            threads = [self._accepter, *self._threads]
        deadline = time.monotonic() + THREAD_STOP_S
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def forget(self) -> None:
        """In a forked child: close the inherited sockets, leaving the parent's alone."""
        self._listener.close()
        for connection in list(self._connections):
            connection.close()


class _Connection:
    """A consumer's connection to the owner: one request and its reply at a time."""

    def __init__(self, address: str, index: int, timeout: float) -> None:
        self.address, self.index = address, index
        self.socket = _connect(address, timeout)
        self.reader = wire.FrameReader(self.socket.fileno())
        self.owner_pid = 0
        self.close = weakref.finalize(self, self.socket.close)
        _CONNECTIONS.add(self)

    def _owner_alive(self) -> bool:
        check_interrupt()
        return self.owner_pid == 0 or parent_alive(self.owner_pid)

    def call(self, request: tuple[Any, ...]) -> Any:
        """Send `request`, return the owner's answer (raising its error)."""
        try:
            _send(self.socket, request)
        except OSError:  # the connection was reset: the owner is gone
            self._lost()
        return self.opened(self._receive())

    def fetch(self, most: int) -> list[bytearray]:
        """The replies of this consumer's next item and of up to `most` - 1 more."""
        count: int = self.call(("next", most))
        return [self._receive() for _ in range(count)]

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
        raise WorkerError(
            f"{NAME}: the owner (pid {self.owner_pid or 'unknown'}) serving "
            f"{self.address} closed or died while consumer {self.index} waited for "
            "it; attach again to a new owner and setstate() from a checkpoint"
        )

    @staticmethod
    def opened(frame: bytes | bytearray) -> Any:
        """The value of a reply, or its error raised (StopIteration at the end)."""
        reply = pickle.loads(frame)
        if reply[0] == "end":
            raise StopIteration
        if reply[0] == "error":
            raise as_exception(reply[1])
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
        self._replies: deque[bytearray] = deque()

    def __iter__(self) -> _Remote:
        return self

    def __next__(self) -> Any:
        if not self._replies:
            self._replies.extend(self._fetch(self._prefetch))
        return self._opened(self._replies.popleft())

    def held(self) -> int:
        """Items received and not used yet."""
        return len(self._replies)


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
        self._count, self._mode, connection.owner_pid = connection.call(
            ("attach", index, os.getpid())
        )
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
                self._final = connection.call(("close", self._held()))
        super().close()
        connection.hang_up()


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
    for server in list(_SERVERS):
        server.forget()
    for connection in list(_CONNECTIONS):
        connection.socket.close()  # in the child only: the parent's stays open
    _SERVERS.clear()
    _CONNECTIONS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
