"""A rate-capping HTTP proxy on 127.0.0.1, in front of the loopback S3 server (test/_s3.py).

`ThrottlingProxy` forwards every request unchanged and sends each answer's body no faster
than `rate` bytes per second, per request (as object stores cap each connection), so that
only requests in flight at once add up to more. It counts the requests by method, the body
bytes of the GET answers per object path (counted as the answer starts), and the answers
being sent (and the most at once since `reset`); an answer whose client closed its
connection ends at its next write. Use it as a context manager, or call `stop`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler

from _s3 import LoopbackServer, ProxyHandler, _relay

SLICE = 1 << 16
"""Bytes written at a time (the pacing step), by default."""


class ThrottlingProxy(LoopbackServer):
    """A proxy on 127.0.0.1 in front of `target` (a URL) capping each answer at `rate`
    bytes per second (None: no cap; it may be changed at any time, also for the answers
    being sent), written `step` bytes at a time; `endpoint` is its URL."""

    def __init__(self, target: str, rate: float | None, step: int = SLICE) -> None:
        self.target, self.rate, self.step = target, rate, step
        self._sending = self._most_sending = 0
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._gets: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._serve(_handler_class(self), "test-throttling-proxy")

    def count(self, method: str, path: str, sent: int) -> None:
        with self._lock:
            self._requests[method] += 1
            if method == "GET":
                self._gets[path] += 1
                self._bytes[path] += sent

    def requests(self, method: str = "GET") -> int:
        """How many requests with `method` it forwarded."""
        with self._lock:
            return self._requests[method]

    def gets(self, part: str = "") -> int:
        """GET requests of paths containing `part`."""
        with self._lock:
            return sum(n for path, n in self._gets.items() if part in path)

    def bytes_sent(self, part: str = "") -> int:
        """Body bytes of the GET answers of paths containing `part`."""
        with self._lock:
            return sum(n for path, n in self._bytes.items() if part in path)

    def answering(self) -> int:
        """Answers whose body is being sent now."""
        with self._lock:
            return self._sending

    def most_answering(self) -> int:
        """The most answers sent at once since the proxy started or was `reset`."""
        with self._lock:
            return self._most_sending

    def sending(self, change: int) -> None:
        with self._lock:
            self._sending += change
            self._most_sending = max(self._most_sending, self._sending)

    def reset(self) -> None:
        with self._lock:
            self._requests.clear()
            self._gets.clear()
            self._bytes.clear()
            self._most_sending = self._sending


def _handler_class(proxy: ThrottlingProxy) -> type[BaseHTTPRequestHandler]:
    host, port = proxy.target.split("://", 1)[1].split(":")

    class Handler(ProxyHandler):
        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, headers, payload = _relay(host, int(port), self, body)
            path = self.path.split("?", 1)[0]  # counted first: the client may be done
            proxy.count(self.command, path, 0 if self.command == "HEAD" else len(payload))
            self._answer(status, headers, payload)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        def _answer(self, status: int, headers: Mapping[str, str], payload: bytes) -> None:
            self._send_head(status, headers, len(payload))
            if self.command == "HEAD":
                return
            started, step = time.perf_counter(), proxy.step
            proxy.sending(1)
            try:
                for offset in range(0, len(payload), step):
                    self.wfile.write(payload[offset : offset + step])
                    if proxy.rate:  # sleep until the bytes sent so far are due
                        due = started + (offset + step) / proxy.rate
                        time.sleep(max(0.0, due - time.perf_counter()))
            except (BrokenPipeError, ConnectionResetError):  # the client closed it
                self.close_connection = True
            finally:
                proxy.sending(-1)

    return Handler
