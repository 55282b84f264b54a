"""The retry policy of infinibatch_like.io: which errors are transient, backoff, counts."""

from __future__ import annotations

import errno
import hashlib
import io
import math
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from infinibatch_like.io import (
    ChunkAccessError,
    ChunkNotFoundError,
    ChunkReadError,
    RetryPolicy,
    reset_retry_counts,
    retry_counts,
)
from infinibatch_like.io import retry as retry_module
from infinibatch_like.io._storage import RemoteRaw
from infinibatch_like.io.retry import call_with_retries, transient_cause

FAST = RetryPolicy(tries=4, first_delay=0.01, max_delay=0.05)


def client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "..."}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


def caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


@pytest.fixture(autouse=True)
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    waits: list[float] = []
    monkeypatch.setattr(retry_module.time, "sleep", waits.append)
    reset_retry_counts()
    yield waits
    reset_retry_counts()


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (client_error("SlowDown", 503), "SlowDown"),
        (caused(OSError(errno.EIO, "busy"), client_error("SlowDown", 503)), "SlowDown"),
        (client_error("InternalError", 500), "InternalError"),
        (client_error("", 502), "502"),
        (client_error("AccessDenied", 403), None),
        (client_error("NoSuchKey", 404), None),
        (caused(FileNotFoundError("key"), client_error("NoSuchKey", 404)), None),
        (ConnectionResetError(errno.ECONNRESET, "reset"), "ConnectionResetError"),
        (TimeoutError("timed out"), "TimeoutError"),
        (aiohttp.ClientPayloadError("cut"), "ClientPayloadError"),
        (aiohttp.ServerDisconnectedError(), "ServerDisconnectedError"),
        (ReadTimeoutError(endpoint_url="http://x"), "ReadTimeoutError"),
        (OSError(errno.ECONNRESET, "reset by peer"), "ConnectionResetError"),
        (ValueError("bad"), None),
        (PermissionError("no"), None),
    ],
)
def test_transient_errors_are_told_from_permanent_ones(
    error: BaseException, cause: str | None
) -> None:
    assert transient_cause(error) == cause


def test_aiohttp_status_errors() -> None:
    def response_error(status: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(None, (), status=status)  # type: ignore[arg-type]

    assert transient_cause(response_error(503)) == "HTTP 503"
    assert transient_cause(response_error(429)) == "HTTP 429"
    assert transient_cause(response_error(404)) is None


def test_transient_failures_are_retried_with_growing_jittered_waits(sleeps: list[float]) -> None:
    failures = [ConnectionResetError("reset"), client_error("SlowDown", 503), TimeoutError()]

    def action() -> str:
        if failures:
            raise failures.pop(0)
        return "done"

    policy = RetryPolicy(tries=4, first_delay=0.1, max_delay=0.3)
    assert call_with_retries(action, "s3://b/k", "reading", policy) == "done"
    assert retry_counts() == {"ConnectionResetError": 1, "SlowDown": 1, "TimeoutError": 1}
    caps = [0.1, 0.2, 0.3]
    assert all(cap / 2 <= wait <= cap for wait, cap in zip(sleeps, caps, strict=True))


def test_last_try_names_the_chunk_and_the_cause(sleeps: list[float]) -> None:
    def action() -> None:
        raise client_error("SlowDown", 503)

    with pytest.raises(ChunkReadError, match=r"reading s3://b/k failed after 3 tries; .*SlowDown"):
        call_with_retries(action, "s3://b/k", "reading", RetryPolicy(tries=3))
    assert len(sleeps) == 2
    assert retry_counts() == {"SlowDown": 2}


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (client_error("NoSuchKey", 404), ChunkNotFoundError, "s3://b/k: no such file or object"),
        (client_error("InvalidAccessKeyId", 403), ChunkAccessError, "s3://b/k: access denied"),
        (PermissionError("Forbidden"), ChunkAccessError, "check the credentials"),
        (ValueError("odd"), ChunkReadError, "reading s3://b/k failed: ValueError: odd"),
    ],
)
def test_other_errors_fail_at_once(sleeps: list[float], error, kind, message) -> None:
    def action() -> None:
        raise error

    with pytest.raises(kind, match=message):
        call_with_retries(action, "s3://b/k", "reading")
    assert sleeps == []
    assert retry_counts() == {}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"tries": 0}, "tries must be an int >= 1, got 0"),
        ({"tries": 2.5}, "tries must be an int >= 1, got 2.5"),
        ({"first_delay": 2.0, "max_delay": 1.0}, "need 0 <= first_delay <= max_delay"),
        ({"first_delay": -1.0}, "need 0 <= first_delay <= max_delay"),
    ],
)
def test_retry_policy_refuses_bad_arguments(arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**arguments)


class _Breaking(io.RawIOBase):
    """A file without byte ranges (as ``memory://`` files) that resets once, after
    `cut` bytes, if `breaks` holds a count."""

    def __init__(self, data: bytes, start: int, breaks: list[int], cut: int) -> None:
        self._data, self._position, self._breaks, self._cut = data, start, breaks, cut
        self.details = {"size": len(data), "ETag": hashlib.md5(data).hexdigest()}

    def readable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = 0) -> int:
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        if self._breaks and self._position >= self._cut:
            self._breaks.pop()
            raise ConnectionResetError("reset by peer")
        piece = self._data[self._position : self._position + min(len(buffer), 1000)]
        buffer[: len(piece)] = piece
        self._position += len(piece)
        return len(piece)


class _Store:
    """An fsspec-like file system of one object (`versions[-1]`), whose files break."""

    def __init__(self, versions: list[bytes], breaks: int, cut: int) -> None:
        self.versions, self.breaks, self.cut = versions, [1] * breaks, cut

    def open(self, path: str, mode: str) -> _Breaking:
        return _Breaking(self.versions[-1], 0, self.breaks, self.cut)


def test_a_file_without_ranges_is_reopened_at_the_byte_it_failed(
    sleeps: list[float],
) -> None:
    data = bytes(range(256)) * 40
    store = _Store([data], breaks=2, cut=5000)
    raw = RemoteRaw(store, "k", "x://k", FAST, store.open("k", "rb"))
    assert b"".join(iter(lambda: raw.read(700), b"")) == data
    assert retry_counts() == {"ConnectionResetError": 2}


def test_a_file_without_ranges_that_changed_is_not_spliced(sleeps: list[float]) -> None:
    store = _Store([b"a" * 9000], breaks=1, cut=5000)
    raw = RemoteRaw(store, "k", "x://k", FAST, store.open("k", "rb"))
    assert [raw.read(5000) for _ in range(5)] == [b"a" * 1000] * 5
    store.versions.append(b"b" * 9000)
    with pytest.raises(ChunkReadError, match=r"x://k changed while it was being read"):
        raw.read(1000)


def test_a_long_run_of_transient_failures_never_overflows_the_backoff(sleeps: list[float]) -> None:
    failures = iter(range(1100))

    def action() -> str:
        if next(failures, None) is not None:
            raise ConnectionResetError("reset")
        return "done"

    policy = RetryPolicy(tries=10**9, first_delay=0, max_delay=0)
    assert call_with_retries(action, "s3://b/k", "reading", policy) == "done"
    assert sleeps == [0.0] * 1100
    assert retry_counts() == {"ConnectionResetError": 1100}


@pytest.mark.parametrize(
    ("first_delay", "max_delay", "retry"),
    [
        *[
            (first, top, n)
            for first, top in [(0.1, 2.0), (2.0, 2.0), (1.0, 1e308)]
            for n in (1025, 1100)
        ],
        *[
            (first, top, n)
            for first, top in [(5e-324, 1e308), (1e-300, 1e300)]
            for n in (2200, 10**6)
        ],
        (0.1, 2.0, 10**30),
        (5e-324, 1.7e308, 10**30),
    ],
)
def test_backoff_is_capped_by_max_delay_for_any_retry_number(
    retry: int, first_delay: float, max_delay: float
) -> None:
    policy = RetryPolicy(tries=3, first_delay=first_delay, max_delay=max_delay)
    waits = [policy.delay(retry) for _ in range(20)]
    assert all(max_delay / 2 <= wait <= max_delay for wait in waits)
    assert len(set(waits)) > 1  # half of each wait is jitter


def test_backoff_doubles_from_first_delay_then_stops_at_max_delay() -> None:
    policy = RetryPolicy(tries=3, first_delay=1e-300, max_delay=1e300)
    # 1e-300 * 2 ** 1993 < 1e300 < 1e-300 * 2 ** 1994: retry 1994 is the last one below the cap
    for retry, cap in [(1993, math.ldexp(1e-300, 1992)), (1994, math.ldexp(1e-300, 1993))]:
        assert cap / 2 <= policy.delay(retry) <= cap < 1e300
    assert 1e300 / 2 <= policy.delay(1995) <= 1e300


@pytest.mark.parametrize("retry", [0, -1, -(10**30), 1.5, True, "2"])
def test_backoff_refuses_a_retry_number_below_one_or_not_an_int(retry: object) -> None:
    with pytest.raises(
        ValueError, match=f"RetryPolicy.delay: retry must be an int >= 1, got {retry!r}"
    ):
        RetryPolicy().delay(retry)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_delay": float("inf")}, "max_delay must be a finite number, got inf"),
        ({"first_delay": float("nan")}, "first_delay must be a finite number, got nan"),
        ({"first_delay": "0.1"}, "first_delay must be a finite number, got '0.1'"),
        ({"max_delay": None}, "max_delay must be a finite number, got None"),
        ({"first_delay": True}, "first_delay must be a finite number, got True"),
        ({"max_delay": 10**400}, "max_delay must be a finite number, got 1000"),
    ],
)
def test_retry_policy_refuses_delays_that_are_not_finite_numbers(arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**arguments)
