"""A real S3 API on loopback for tests, tutorials and benchmarks: moto's standalone server,
and a fault-injecting proxy in front of it.

`S3Server` runs ``moto.server.ThreadedMotoServer`` on 127.0.0.1 (a free port). `FaultyProxy`
forwards HTTP requests to it unchanged, except that it can answer the next k matching
requests with a real ``503 SlowDown`` S3 error, cut the next k matching answers in the
middle of their body (a connection reset), and delay every answer: failures on the wire,
met by s3fs/botocore exactly as from a real store. Nothing of the library is mocked.

The pytest fixtures built on them are in ``test/conftest.py``: ``s3`` (a fresh bucket on the
session's server, with the ``AWS_*`` environment of a user pointed at it) and ``s3_proxy``.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from infinibatch_like.io import RetryPolicy

FAST = RetryPolicy(tries=4, first_delay=0.01, max_delay=0.05)
"""Retries quick enough for tests of faults injected by the proxies."""

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please '
    b"reduce your request rate.</Message><RequestId>PROXY</RequestId></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class S3Server:
    """moto's S3 server on 127.0.0.1, on a free port; `endpoint` is its URL."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()

    def client(self, endpoint: str | None = None) -> Any:
        """A boto3 S3 client of the server (or of a proxy in front of it)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self) -> str:
        name = f"bucket-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


class _Listener(ThreadingHTTPServer):
    """Accepts a burst of connections at once: with the standard backlog of 5, a client
    opening 8 at once (concurrent ranges) while the accepting thread waits for the GIL
    has its extra connections dropped and retried by TCP a second later."""

    request_queue_size = 128


class LoopbackServer:
    """An HTTP server on 127.0.0.1 (a free port) that a daemon thread runs; `endpoint` is
    its URL. Use it as a context manager, or call `stop`."""

    def _serve(self, handler: type[BaseHTTPRequestHandler], thread_name: str) -> None:
        self._server = _Listener(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=thread_name, daemon=True
        )
        self._thread.start()

    def __enter__(self: Served) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


Served = TypeVar("Served", bound=LoopbackServer)


class ProxyHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler that sends an answer's status line and headers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send_head(self, status: int, headers: Mapping[str, str], length: int) -> None:
        """The status and `headers`, with a Content-Length of `length` unless they have one
        (a HEAD answer keeps the object's size)."""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(length))
        self.end_headers()


@dataclass
class Fault:
    """`count` more requests with this method whose path contains `path_part` get `kind`."""

    kind: str  # "slow_down" or "reset"
    count: int
    method: str = "GET"
    path_part: str = ""


@dataclass
class FaultyProxy(LoopbackServer):
    """An HTTP proxy on 127.0.0.1 in front of `target` (a URL), with injected faults."""

    target: str
    delay: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    injected: dict[str, int] = field(default_factory=lambda: {"slow_down": 0, "reset": 0})
    served: list[tuple[str, str, int]] = field(default_factory=list)
    """(method, path, bytes of the answer's body) of every answer relayed from the server."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._serve(_handler_class(self), "test-s3-proxy")

    def inject(self, kind: str, count: int, method: str = "GET", path_part: str = "") -> None:
        with self._lock:
            self.faults.append(Fault(kind, count, method, path_part))

    def take_fault(self, method: str, path: str) -> str | None:
        """The fault for this request, if one is due (and count it)."""
        with self._lock:
            self.requests.append((method, path))
            for fault in self.faults:
                if fault.count and fault.method == method and fault.path_part in path:
                    fault.count -= 1
                    self.injected[fault.kind] += 1
                    return fault.kind
        return None


def _handler_class(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    host, port = proxy.target.split("://", 1)[1].split(":")

    class Handler(ProxyHandler):
        def _forward(self) -> None:
            body = self._request_body()
            if proxy.delay:
                time.sleep(proxy.delay)
            fault = proxy.take_fault(self.command, self.path)
            if fault == "slow_down":
                self._answer(503, {"Content-Type": "application/xml"}, _SLOW_DOWN)
                return
            status, headers, payload = _relay(host, int(port), self, body)
            with proxy._lock:
                proxy.served.append((self.command, self.path, len(payload)))
            if fault == "reset" and len(payload) > 1:
                self._answer_then_reset(status, headers, payload)
                return
            self._answer(status, headers, payload)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        def _request_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                pieces = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    pieces.append(self.rfile.read(size))
                    self.rfile.readline()
                    if size == 0:
                        return b"".join(pieces)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer(self, status: int, headers: Mapping[str, str], payload: bytes) -> None:
            self._send_head(status, headers, len(payload))
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _answer_then_reset(
            self, status: int, headers: Mapping[str, str], payload: bytes
        ) -> None:
            """Announce the whole body, send half of it, and reset the connection (RST)."""
            self._send_head(status, {**headers, "Content-Length": str(len(payload))}, 0)
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.connection.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
            self.close_connection = True
            self.connection.close()

    return Handler


def _relay(
    host: str, port: int, request: BaseHTTPRequestHandler, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.putrequest(
            request.command, request.path, skip_host=True, skip_accept_encoding=True
        )
        for name, value in request.headers.items():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        payload = response.read()
        dropped = _HOP_BY_HOP if request.command == "HEAD" else {*_HOP_BY_HOP, "content-length"}
        headers = {
            name: value for name, value in response.getheaders() if name.lower() not in dropped
        }
        return response.status, headers, payload
    finally:
        connection.close()


def put_objects(client: Any, bucket: str, objects: Mapping[str, bytes]) -> None:
    for key, data in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


