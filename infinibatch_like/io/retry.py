"""Retries of transient storage failures: which errors are transient, the backoff, the counts.

Remote reads, listings and writes go through `call_with_retries`: an error that a later try
may not meet (a 5xx answer, S3 ``SlowDown`` throttling, a reset connection, a timeout) is
retried after an exponential backoff with jitter, up to `RetryPolicy.tries` tries; each retry
is logged (logger ``infinibatch_like.io``, level WARNING) and counted in `retry_counts`. Any
other error (a missing object, refused credentials) is raised at once. Local files are never
retried.
"""

from __future__ import annotations

import errno
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ChunkAccessError, ChunkError, ChunkNotFoundError, ChunkReadError

T = TypeVar("T")
logger = logging.getLogger("infinibatch_like.io")

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)
_TRANSIENT_TYPE_NAMES = frozenset(
    {  # matched by name anywhere in an error's class hierarchy, so nothing is imported
        "ClientConnectionError",  # aiohttp (resets, disconnects, refused connections)
        "ClientPayloadError",  # aiohttp: a body cut short
        "ServerTimeoutError",  # aiohttp
        "FSTimeoutError",  # fsspec
        "HTTPClientError",  # botocore: connection and read failures
        "ResponseStreamingError",  # botocore: a body cut short
        "IncompleteRead",  # http.client, urllib3
        "ProtocolError",  # urllib3
        "ResponseParserError",  # botocore: throttling answers with broken XML
        "TransportError",  # google-auth
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "403",
        "401",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, transient storage failures are retried.

    Try ``k`` (from 2) waits ``min(max_delay, first_delay * 2 ** (k - 2))`` seconds, of which
    a random half is jitter (so that many readers throttled together do not retry together).

    Args:
        tries: how many tries in all (>= 1; 1 never retries).
        first_delay: the wait before the first retry, in seconds (>= 0, finite).
        max_delay: the longest wait between two tries, in seconds (>= first_delay, finite).
    """

    tries: int = 6
    first_delay: float = 0.2
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.tries, bool) or not isinstance(self.tries, int) or self.tries < 1:
            raise ValueError(f"RetryPolicy: tries must be an int >= 1, got {self.tries!r}")
        for name in ("first_delay", "max_delay"):
            value = getattr(self, name)
            if not _is_finite_number(value):
                raise ValueError(f"RetryPolicy: {name} must be a finite number, got {value!r}")
        if not 0 <= self.first_delay <= self.max_delay:
            raise ValueError(
                "RetryPolicy: need 0 <= first_delay <= max_delay, got "
                f"first_delay={self.first_delay!r}, max_delay={self.max_delay!r}"
            )

    def delay(self, retry: int) -> float:
        """The wait before retry number `retry` (1 for the second try), with jitter.

        Any retry number is answered without overflow: once the doubled delay would pass
        `max_delay`, the cap is `max_delay` itself.

        Raises:
            ValueError: if `retry` is not an int >= 1.
        """
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
            raise ValueError(f"RetryPolicy.delay: retry must be an int >= 1, got {retry!r}")
        doublings = retry - 1
        if self.first_delay == 0:
            cap = 0.0
        elif doublings >= math.log2(self.max_delay) - math.log2(self.first_delay):
            cap = float(self.max_delay)
        else:  # fewer doublings than it takes to pass max_delay: the product is finite
            cap = min(self.max_delay, math.ldexp(self.first_delay, doublings))
        return cap / 2 + _jitter.uniform(0, cap / 2)


def _is_finite_number(value: object) -> bool:
    """Whether `value` is an int or float (not a bool) that is a finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the largest float
        return False


DEFAULT_RETRY = RetryPolicy()
"""The policy of every remote operation that is not given one: 6 tries, 0.2 s to 10 s."""

_jitter = random.Random()  # backoff jitter only: never touches the data order
_lock = threading.Lock()
_counts: Counter[str] = Counter()


def retry_counts() -> dict[str, int]:
    """How many retries this process made, by cause (e.g. ``{"SlowDown": 3,
    "ClientPayloadError": 1}``), since it started or since `reset_retry_counts`.

    Worker processes (e.g. DataLoader workers) count their own retries.
    """
    with _lock:
        return dict(_counts)


def reset_retry_counts() -> None:
    """Set every count of `retry_counts` back to zero."""
    with _lock:
        _counts.clear()


def call_with_retries(
    action: Callable[[], T],
    ref: str,
    doing: str,
    policy: RetryPolicy | None = None,
    stop: threading.Event | None = None,
) -> T:
    """``action()``, tried again after each transient failure, up to ``policy.tries`` tries.

    Args:
        action: the storage operation (it must be safe to repeat).
        ref: the chunk, object or pattern it is about (named in logs and errors).
        doing: what it does, for messages (e.g. ``"reading"``).
        policy: the retry policy (`DEFAULT_RETRY` if None).
        stop: an event that ends the wait before a retry, and the retries (its reader was
            closed).

    Raises:
        ChunkNotFoundError, ChunkAccessError: at once, for a missing object or refused access.
        ChunkReadError: for another non-transient error (at once), or after the last try.
        ChunkError: an error that already names its chunk, unchanged.
        ChunkReadError: when `stop` is set during a wait before a retry, or when a try
            fails once it is set (its request was cancelled).
    """
    policy = DEFAULT_RETRY if policy is None else policy
    for attempt in range(1, policy.tries + 1):
        try:
            return action()
        except ChunkError:
            raise
        except Exception as error:
            if stop is not None and stop.is_set():
                raise _given_up(doing, ref) from error
            cause = transient_cause(error)
            if cause is None:
                raise named_error(error, ref, doing) from error
            if attempt == policy.tries:
                raise ChunkReadError(
                    f"{doing} {ref} failed after {policy.tries} tries; the last error: "
                    f"{_describe(error)}"
                ) from error
            wait = policy.delay(attempt)
            with _lock:
                _counts[cause] += 1
            logger.warning(
                "retrying %s %s (try %d of %d) in %.2f s after %s",
                doing,
                ref,
                attempt + 1,
                policy.tries,
                wait,
                _describe(error),
            )
            if stop is None:
                time.sleep(wait)
            elif stop.wait(wait):
                raise _given_up(doing, ref) from error
    raise AssertionError("unreachable: the last try returns or raises")  # pragma: no cover


def _given_up(doing: str, ref: str) -> ChunkReadError:
    return ChunkReadError(f"{doing} {ref} was given up: its reader was closed")


def named_error(error: BaseException, ref: str, doing: str) -> ChunkError:
    """The non-transient `error` as one of this package's errors, naming `ref`."""
    code = _error_code(error)
    if "NoSuchBucket" in error_codes(error):
        return ChunkNotFoundError(f"{ref}: its bucket does not exist ({_describe(error)})")
    if isinstance(error, FileNotFoundError) or code in _NOT_FOUND_CODES:
        return ChunkNotFoundError(f"{ref}: no such file or object ({_describe(error)})")
    if isinstance(error, PermissionError) or code in _ACCESS_CODES:
        return ChunkAccessError(
            f"{ref}: access denied while {doing} it; check the credentials and the "
            f"permissions ({_describe(error)})"
        )
    return ChunkReadError(f"{doing} {ref} failed: {_describe(error)}")


def error_codes(error: BaseException) -> list[str]:
    """The botocore error codes (e.g. ``"PreconditionFailed"``) of `error` and its causes."""
    return [code for code in map(_error_code, _chain(error)) if code is not None]


def transient_cause(error: BaseException) -> str | None:
    """A short name of the transient failure behind `error` (e.g. ``"SlowDown"``,
    ``"ConnectionResetError"``), or None if a retry would not help."""
    for link in _chain(error):
        if isinstance(link, (FileNotFoundError, PermissionError, ChunkError)):
            return None
        code = _error_code(link)
        if code is not None:
            return code if code in _TRANSIENT_CODES else None
        status = _http_status(link)
        if status is not None:
            return f"HTTP {status}" if status >= 500 or status == 429 else None
        names = {cls.__name__ for cls in type(link).__mro__}
        if isinstance(link, (ConnectionError, TimeoutError)) or names & _TRANSIENT_TYPE_NAMES:
            return type(link).__name__
        if isinstance(link, OSError) and link.errno in (errno.ECONNRESET, errno.ETIMEDOUT):
            return type(link).__name__
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and its causes and contexts (at most 20, without cycles)."""
    links: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and len(links) < 20 and all(link is not seen for seen in links):
        links.append(link)
        link = link.__cause__ or link.__context__
    return links


def _error_code(error: BaseException) -> str | None:
    """The error code of a botocore ``ClientError`` (e.g. ``"SlowDown"``), else None."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    if code:
        return str(code)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(status) if status else None


def _http_status(error: BaseException) -> int | None:
    """The HTTP status of an aiohttp/gcsfs-style error (``status`` or ``code``), else None."""
    for attribute in ("status", "code"):
        value = getattr(error, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def _describe(error: BaseException) -> str:
    """``Type: message`` of `error`, with the store's error code where there is one."""
    code = next((c for c in map(_error_code, _chain(error)) if c), None)
    text = f"{type(error).__name__}: {error}"
    return text if code is None or code in text else f"{text} [{code}]"
