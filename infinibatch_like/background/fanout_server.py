"""The owner's side of fan-out consumers in other processes: a `Server` answers, on a
Unix socket, the consumers that attach to it (see `fanout_remote` for the protocol).

Each item is pickled once for every consumer, its large numpy arrays and CPU tensors
put once into shared memory (`shm_broadcast`) that each consumer maps. A reply is kept,
and its segments named, while a consumer may still take its item or has been sent it
and not yet mapped it: a consumer maps the items it is sent before its next request (or
is gone), so that request releases them."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import sys
import threading
import time
import weakref
from typing import Any

from . import segments, shm_broadcast, wire
from .errors import report_error
from .fanout_hub import NAME, Hub
from .lifecycle import POLL_S, THREAD_STOP_S, Resource

SEND_TIMEOUT_S = 60.0
"""How long sending one message may block on a peer that does not read (seconds)."""

_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


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


class _Reply:
    """An item's reply, pickled once for every consumer; `names`: the segments it refers
    to; `pending`: the consumers it was sent to that have not mapped it yet."""

    __slots__ = ("data", "names", "pending")

    def __init__(self, data: bytes, names: list[str]) -> None:
        self.data, self.names, self.pending = data, names, 0


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
        self._replies: dict[int, _Reply] = {}
        self._claiming: dict[int, int] = {}
        """The next position of each consumer whose thread is taking an item."""
        self._pickling = threading.Lock()
        """Held while an item is pickled: each is pickled once, whichever thread asks."""
        self._broadcast = shm_broadcast.Broadcast() if segments.ENABLED else None
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
        sent: list[_Reply] = []
        try:
            reader = wire.FrameReader(connection.fileno())
            frame = self._receive(reader)
            if frame is None:
                return
            _, wanted, pid = pickle.loads(frame)
            try:
                self.hub.claim(wanted, f"attached by process {pid}")
            except (TypeError, ValueError) as error:
                wire.send_frames(connection, ("error", report_error(error, self._where())))
                return
            index = wanted
            self.hub.connected(index, True)
            prefix = None if self._broadcast is None else self._broadcast.prefix
            hub = self.hub
            wire.send_frames(connection, ("ok", (hub.consumers, hub.mode, os.getpid(), prefix)))
            while (frame := self._receive(reader)) is not None:
                self._mapped(sent)  # a request comes once the previous items are mapped
                sent = []
                request = pickle.loads(frame)
                reply = self._answer(index, request, connection)
                closed = request[0] == "close"
                if isinstance(reply, list):  # items: their count, then each
                    sent = [r for r in reply if isinstance(r, _Reply)]
                    frames = [r.data if isinstance(r, _Reply) else r for r in reply]
                    wire.send_frames(connection, ("items", len(reply)), *frames)
                else:
                    wire.send_frames(connection, reply)
                if closed:
                    return
        except OSError:  # the consumer went away mid-message
            pass
        finally:
            self._mapped(sent)  # or never will be: its process is gone
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
            self._claim(index)
            first = hub.take_at(index, lambda: _gone(connection))
            assert first is not None
            replies.append(self._reply(index, *first))
            while len(replies) < most and isinstance(replies[-1], _Reply):
                self._claim(index)
                following = hub.take_at(index, wait=False)
                if following is None:
                    break
                replies.append(self._reply(index, *following))
        except StopIteration:
            replies.append(("end",))
        except BaseException as error:  # re-raised in the consumer at its item
            replies.append(("error", report_error(error, self._where(), hub.source)))
        finally:
            hub.lend(index, len(replies))
            with self._lock:
                self._claiming.pop(index, None)
        return replies

    def _claim(self, index: int) -> None:
        """Consumer `index` is about to take its next item: its reply is kept, though the
        hub may drop the item as it hands it over."""
        with self._lock:
            self._claiming[index] = self.hub.next_index(index)

    def _reply(self, index: int, position: int, item: Any) -> _Reply | tuple[Any, ...]:
        """The reply for the item at upstream `position`, pickled once for every consumer
        (kept while a consumer may still take it), counted as sent to consumer `index`."""
        with self._pickling:
            with self._lock:
                reply = self._replies.get(position)
            if reply is None:
                try:
                    reply = self._encoded(("ok", item))
                except Exception as error:
                    return ("error", report_error(error, f"pickling an item {self._where()}"))
            with self._lock:
                reply.pending += 1
                self._replies[position] = reply
                self._claiming.pop(index, None)
                self._trim()
        return reply

    def _encoded(self, reply: tuple[str, Any]) -> _Reply:
        if self._broadcast is None or (
            "numpy" not in sys.modules and "torch" not in sys.modules
        ):
            return _Reply(pickle.dumps(reply, wire.PROTOCOL), [])
        return _Reply(*self._broadcast.encode(reply))

    def _mapped(self, replies: list[_Reply]) -> None:
        """A consumer has mapped `replies` (or is gone): their segments may go once no
        consumer needs their items any more."""
        if replies:
            with self._lock:
                for reply in replies:
                    reply.pending -= 1
                self._trim()

    def _trim(self) -> None:
        """Drop the replies that no consumer needs or still has to map (every reply once
        stopped), and unlink their segments; holding `_lock`."""
        oldest = None if self._stop.is_set() else min([self.hub.base, *self._claiming.values()])
        stale = [
            position
            for position, reply in self._replies.items()
            if (oldest is None or position < oldest) and reply.pending <= 0
        ]
        for position in stale:
            shm_broadcast.unlink(self._replies.pop(position).names)

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
        with self._lock:  # what the consumers did not map they never will
            for reply in self._replies.values():
                shm_broadcast.unlink(reply.names)
            self._replies.clear()

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


def _after_fork_in_child() -> None:
    for server in list(_SERVERS):
        server.forget()
    _SERVERS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
