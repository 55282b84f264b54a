"""The owner's side of fan-out consumers in other processes: a `Server` answers, on a
Unix socket, the consumers that attach to it (see `fanout_remote` for the protocol).

One thread serves every connection, with non-blocking sockets (one thread, not one per
consumer: threads that hand the interpreter over to each other at every message cost
more CPU than the messages). It reads the upstream itself when a consumer needs an item
that is not read yet; a request that must wait (its consumer `max_lag` items ahead, or
another thread of the owner reading the upstream) is kept and answered once the hub
says that the consumers moved (`Hub.on_change`).

Each item is pickled once for every consumer, its large numpy arrays and CPU tensors
put once into shared memory (`shm_broadcast`) that each consumer maps. The pickled reply
is written once into a ring of shared memory (`shm_arena`) that each consumer process
maps at attach and reads in place: a consumer is sent where its items lie, not their
bytes. A reply is kept while a consumer may still take its item; its segments are held
until then, and by each consumer process it was sent to until that process reports its
mappings collected (with its next request) or is gone; its place in the ring, until each
consumer it was sent to asks for more (it has read the reply then) or is gone."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import selectors
import socket
import stat
import sys
import threading
import time
import weakref
from typing import Any

from . import segments, shm_arena, shm_broadcast, wire
from .errors import report_error
from .fanout_hub import NAME, Hub
from .lifecycle import POLL_S, THREAD_STOP_S, Resource

SEND_TIMEOUT_S = 60.0
"""How long a peer may leave a message unread before it is disconnected (seconds)."""

SWEEP_S = 5.0
"""How often the server looks for dead processes that hold segments (seconds)."""

_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()
_LISTENERS: weakref.WeakSet[socket.socket] = weakref.WeakSet()
"""Every listening socket of this process's servers, from its creation: a child forked
while its server is being set up (by another thread) closes it too, or it would keep
answering at the address once the owner died."""


class _Reply:
    """An item's reply, pickled once for every consumer; `names`: the segments it refers
    to; `span`: where it lies in the ring (None: not there, its bytes are sent)."""

    __slots__ = ("data", "names", "span")

    def __init__(self, data: bytes, names: list[str]) -> None:
        self.data, self.names = data, names
        self.span: shm_arena.Span | None = None


class _Client:
    """A connection and where its consumer is in the protocol."""

    __slots__ = (
        "closed",
        "connection",
        "index",
        "outgoing",
        "pid",
        "reader",
        "reading",
        "ring",
        "since",
        "wants",
    )

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.reader = wire.FrameReader(connection.fileno())
        self.index = -1
        """Its consumer, once attached (-1: not yet)."""
        self.pid = 0
        """Its process, once attached."""
        self.wants = 0
        """The `most` of a ``("next", most, released)`` request not answered yet (0: none)."""
        self.outgoing: list[memoryview] = []
        """What is left to send of its last answer."""
        self.since = 0.0
        """When sending `outgoing` began."""
        self.closed = False
        """It asked to close: the connection ends once the answer is sent."""
        self.ring = False
        """Its process mapped the ring: its replies are sent as spans of it."""
        self.reading: list[shm_arena.Span] = []
        """The spans of its last answer (held until its next request)."""


class Server(Resource):
    """Serves the consumers of `hub` to processes that attach at `address`."""

    def __init__(self, hub: Hub, address: str) -> None:
        self.hub, self.address = hub, address
        listener = _listening(address)
        os.chmod(address, 0o600)
        listener.listen()
        listener.setblocking(False)
        super().__init__()
        self._listener = listener
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """Held while the replies change (`_shutdown` may come from another thread)."""
        self._clients: dict[socket.socket, _Client] = {}
        self._replies: dict[int, _Reply] = {}
        self._claiming: dict[int, int] = {}
        """The next position of each consumer that is taking an item."""
        self._broadcast = shm_broadcast.Broadcast() if segments.ENABLED else None
        self._ring = None if self._broadcast is None else _ring(self._broadcast.prefix)
        self._next_sweep = 0.0
        """When to look again for dead processes that hold segments (`Broadcast.sweep`)."""
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        hub.on_change = self._wake
        self._thread = threading.Thread(
            target=self._run, name=f"infinibatch_like.{NAME}.server", daemon=True
        )
        self._thread.start()
        _SERVERS.add(self)

    # -- the loop ----------------------------------------------------------------------

    def _wake(self) -> None:
        """Have the loop look at its waiting requests again (from another thread)."""
        if threading.current_thread() is not self._thread:
            with self._lock, contextlib.suppress(BlockingIOError):  # full: it wakes anyway
                if self._wake_write >= 0:
                    os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = any(c.wants or c.outgoing for c in self._clients.values())
                for key, events in self._selector.select(POLL_S if busy else None):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj == self._wake_read:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_read, 4096)
                    else:
                        client = self._clients.get(key.fileobj)  # type: ignore[call-overload]
                        if client is not None:
                            self._ready(client, events)
                for client in list(self._clients.values()):
                    if client.wants:
                        self._answer_next(client)
                    elif client.outgoing and time.monotonic() - client.since > SEND_TIMEOUT_S:
                        self._drop(client)  # it does not read
        finally:
            for client in list(self._clients.values()):
                self._drop(client)
            self._release()
            with self._lock:  # a late `_wake` must not write to a reused descriptor
                self._selector.close()
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._wake_read = self._wake_write = -1

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # none waiting, or the listener was closed
                return
            connection.setblocking(False)
            self._clients[connection] = _Client(connection)
            self._selector.register(connection, selectors.EVENT_READ)

    def _ready(self, client: _Client, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(client)
            if events & selectors.EVENT_READ and client.connection in self._clients:
                while (frame := client.reader.read_ready()) is not None:
                    if client.wants or client.outgoing:  # it sends while it should read
                        raise OSError("a request before the answer to the last one")
                    self._request(client, frame)
                    if client.connection not in self._clients:
                        return
        except (EOFError, OSError):  # the consumer went away (mid-message, maybe)
            self._drop(client)

    def _request(self, client: _Client, frame: bytearray) -> None:
        if client.index < 0:
            self._attach(client, frame)
            return
        self._read(client)
        request = pickle.loads(frame)
        if request[0] == "ring":
            client.ring = self._ring is not None and bool(request[1])
            self._send(client, ("ok", None))
            return
        if request[0] in ("next", "close"):
            self._released(client, request[2])
        if request[0] == "next":
            client.wants = max(1, int(request[1]))
            self.hub.lend(client.index, client.wants)  # until it is known how many it holds
            self._claim(client.index)
            self._answer_next(client)
            return
        client.closed = request[0] == "close"
        self._send(client, self._answer(client.index, request))

    def _attach(self, client: _Client, frame: bytearray) -> None:
        _, wanted, pid = pickle.loads(frame)
        try:
            self.hub.claim(wanted, f"attached by process {pid}")
        except (TypeError, ValueError) as error:
            client.closed = True  # refused: the connection ends with the answer
            self._send(client, ("error", report_error(error, self._where())))
            return
        client.index, client.pid = wanted, pid
        self.hub.connected(wanted, True)
        prefix = None if self._broadcast is None else self._broadcast.prefix
        ring = None if self._ring is None else (self._ring.name, self._ring.capacity)
        self._send(client, ("ok", (self.hub.consumers, self.hub.mode, os.getpid(), prefix, ring)))

    def _send(self, client: _Client, *messages: tuple[Any, ...] | bytes) -> None:
        client.outgoing = wire.frames(*messages)
        client.since = time.monotonic()
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        """Send what the socket takes of the answer; the rest once it is writable."""
        had = bool(client.outgoing)
        client.outgoing = wire.send_some(client.connection, client.outgoing)
        if client.outgoing:
            if had:
                self._selector.modify(
                    client.connection, selectors.EVENT_READ | selectors.EVENT_WRITE
                )
            return
        if client.closed:
            self._drop(client)
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(client.connection, selectors.EVENT_READ)

    def _drop(self, client: _Client) -> None:
        """End the connection of `client`; its consumer is released (closed, if it asked)."""
        if self._clients.pop(client.connection, None) is None:
            return
        self._next_sweep = 0.0  # its process may be gone: what it held is free
        self._read(client)
        index = client.index
        if index >= 0:
            with self._lock:
                self._claiming.pop(index, None)
            self.hub.release(index)
            if client.closed:
                self.hub.close_if_done()
            else:
                self.hub.connected(index, False)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.connection)
        client.connection.close()

    # -- answers -----------------------------------------------------------------------

    def _where(self) -> str:
        return f"in the {NAME} owner (pid {os.getpid()}, serving {self.address})"

    def _answer(self, index: int, request: tuple[Any, ...]) -> tuple[Any, ...]:
        hub = self.hub
        try:
            kind = request[0]
            if kind == "getstate":
                return ("ok", hub.state(index, request[1]))
            if kind == "setstate":
                hub.restore_one(index, request[1])
                return ("ok", None)
            state = hub.state(index, request[1])  # the position a restore continues from
            hub.close_consumer(index)
            return ("ok", state)
        except BaseException as error:  # re-raised in the consumer
            return ("error", report_error(error, self._where(), hub.source))

    def _answer_next(self, client: _Client) -> None:
        """Answer a ``("next", most)`` request with the consumer's next item and up to
        ``most - 1`` more that are ready, unless its next item is not to be had yet
        (each the reply of one item, as `_Connection.fetch` reads them)."""
        hub, index, most = self.hub, client.index, client.wants
        replies: list[Any] = []
        try:
            first = hub.take_at(index, wait=False)
            if first is None:
                hub.check_waiting(index)  # raises if the wait must end
                return
            replies.append(self._reply(client, *first))
            while len(replies) < most and isinstance(replies[-1], _Reply):
                following = hub.take_at(index, wait=False)
                if following is None:
                    break
                replies.append(self._reply(client, *following))
        except StopIteration:
            replies.append(("end",))
        except BaseException as error:  # re-raised in the consumer at its item
            replies.append(("error", report_error(error, self._where(), hub.source)))
        hub.lend(index, len(replies))
        with self._lock:  # the replies no consumer needs any more (none while it took)
            self._claiming.pop(index, None)
            self._trim()
        client.wants = 0
        spans: list[tuple[int, int] | None] = []
        frames: list[tuple[Any, ...] | bytes] = []
        for reply in replies:
            span = reply.span if isinstance(reply, _Reply) and client.ring else None
            if span is not None:
                spans.append((span.offset, span.length))
            else:
                spans.append(None)
                frames.append(reply.data if isinstance(reply, _Reply) else reply)
        try:
            self._send(client, ("items", spans), *frames)
        except OSError:
            self._drop(client)

    def _claim(self, index: int) -> None:
        """Consumer `index` is about to take its next items: their replies are kept until
        they are sent, though the hub may drop the items as it hands them over."""
        with self._lock:
            self._claiming[index] = self.hub.next_index(index)

    def _reply(self, client: _Client, position: int, item: Any) -> _Reply | tuple[Any, ...]:
        """The reply for the item at upstream `position`, pickled once for every consumer
        (kept while a consumer may still take it: see `_trim`), its segments and its place
        in the ring held by `client`'s process from now on."""
        reply = self._replies.get(position)
        if reply is None:
            try:
                reply = self._encoded(("ok", item))
            except Exception as error:
                return ("error", report_error(error, f"pickling an item {self._where()}"))
        with self._lock:
            self._replies[position] = reply
            if self._broadcast is not None:  # before `_trim` may let go of the reply's
                self._broadcast.sent(client.pid, reply.names)
            if reply.span is not None and client.ring:
                shm_arena.Ring.hold(reply.span)
                client.reading.append(reply.span)
        return reply

    def _encoded(self, reply: tuple[str, Any]) -> _Reply:
        if self._broadcast is None or ("numpy" not in sys.modules and "torch" not in sys.modules):
            encoded = _Reply(pickle.dumps(reply, wire.PROTOCOL), [])
        else:
            encoded = _Reply(*self._broadcast.encode(reply))
        if self._ring is not None:
            with self._lock:
                encoded.span = self._ring.put(encoded.data)
        return encoded

    def _read(self, client: _Client) -> None:
        """`client` has read the replies of its last answer (it asks for more, or is
        gone): their places in the ring are free of it."""
        with self._lock:
            for span in client.reading:
                shm_arena.Ring.let_go(span)
            client.reading.clear()

    def _released(self, client: _Client, names: list[str]) -> None:
        """The consumer's process collected its mappings of segments `names`; now and
        then, what dead processes held is let go."""
        broadcast = self._broadcast
        if broadcast is not None:
            with self._lock:
                broadcast.released(client.pid, names)
                now = time.monotonic()
                if now >= self._next_sweep:
                    broadcast.sweep(c.pid for c in self._clients.values())
                    self._next_sweep = now + SWEEP_S

    def _trim(self) -> None:
        """Drop the replies that no consumer needs (every reply once stopped), letting go
        of their segments; holding `_lock`."""
        oldest = None if self._stop.is_set() else min([self.hub.base, *self._claiming.values()])
        stale = [position for position in self._replies if oldest is None or position < oldest]
        for position in stale:
            reply = self._replies.pop(position)
            if self._broadcast is not None:
                self._broadcast.drop(reply.names)
            if reply.span is not None:
                shm_arena.Ring.let_go(reply.span)

    # -- stopping ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stop.set()
        self._wake()
        if threading.current_thread() is not self._thread:
            with contextlib.suppress(OSError):  # the consumers see the end of their socket
                for connection in list(self._clients):
                    connection.shutdown(socket.SHUT_RDWR)
            self.join()
            self._release()

    def _release(self) -> None:
        """Stop listening and unlink what the consumers did not map (they never will);
        idempotent."""
        with self.hub.lock:  # called holding it: no thread is in `_wake` after this
            self.hub.on_change = None
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        with self._lock:
            self._replies.clear()
            if self._broadcast is not None:
                self._broadcast.close()
            if self._ring is not None:
                self._ring.close()

    def join(self) -> None:
        """Wait until the thread serving the consumers is gone (unless it is this one:
        the last consumer to close stops the server)."""
        if self._thread is not threading.current_thread():
            self._thread.join(THREAD_STOP_S)

    def forget(self) -> None:
        """In a forked child: close the inherited sockets and descriptors (the listening
        socket is closed with every other of `_LISTENERS`), leaving the parent's alone."""
        for connection in list(self._clients):
            connection.close()
        self._selector.close()
        if self._broadcast is not None:
            self._broadcast.forget()
        if self._ring is not None:
            self._ring.forget()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:  # still open (in the parent, too: the child has copies)
                os.close(fd)


def _ring(prefix: str) -> shm_arena.Ring | None:
    """The ring of the replies of a server whose segments' names start with `prefix`
    (None where /dev/shm has no room for it: replies are sent then)."""
    try:
        return shm_arena.Ring(f"{prefix}ring", shm_arena.CAPACITY)
    except OSError:
        return None


def _listening(address: str) -> socket.socket:
    """A socket bound to `address`, where the socket file of an owner that died (nothing
    answers there) is replaced; ValueError where another owner serves or a file is."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _LISTENERS.add(listener)
    try:
        try:
            listener.bind(address)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            _remove_dead_socket(address)
            listener.bind(address)
    except OSError as error:
        listener.close()
        raise ValueError(
            f"{NAME}.serve: cannot create the socket {address!r} ({error}); give a path "
            "in an existing directory, where no file is"
        ) from error
    except BaseException:
        listener.close()
        raise
    return listener


def _remove_dead_socket(address: str) -> None:
    """Unlink the socket file at `address` if nothing answers there (its owner died);
    ValueError if it is not a socket, or if an owner serves there."""
    if not stat.S_ISSOCK(os.lstat(address).st_mode):
        raise ValueError(
            f"{NAME}.serve: {address!r} exists and is not a socket; give a path where no "
            "file is"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(address)
    except ConnectionRefusedError:  # left by an owner that died (SIGKILL leaves it)
        os.unlink(address)
        return
    finally:
        probe.close()
    raise ValueError(
        f"{NAME}.serve: another owner serves at {address!r}; close it first, or give "
        "another path"
    )


def _after_fork_in_child() -> None:
    for listener in list(_LISTENERS):
        listener.close()
    _LISTENERS.clear()
    for server in list(_SERVERS):
        server.forget()
    _SERVERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
