"""`FetchOptions`: how remote objects are fetched (byte ranges in flight, the local cache),
from a storage option or from environment variables."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

OPTION = "infinibatch_like"
"""The storage option that holds a `FetchOptions` (or a dict of some of its fields); the
library takes it out before the rest goes to the fsspec file system."""

ENVIRONMENT = {
    "ranges_in_flight": "INFINIBATCH_LIKE_RANGES_IN_FLIGHT",
    "range_size": "INFINIBATCH_LIKE_RANGE_SIZE",
    "ranges_from_size": "INFINIBATCH_LIKE_RANGES_FROM_SIZE",
    "cache_dir": "INFINIBATCH_LIKE_CACHE_DIR",
    "cache_size": "INFINIBATCH_LIKE_CACHE_SIZE",
}
"""The environment variable of each field."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: int | str, name: str) -> int:
    """Bytes of `value`: an int, or a str such as ``"512M"``, ``"20GiB"``, ``"1.5T"``
    (binary units); `name` is the option or variable, for the error.

    Raises:
        ValueError, TypeError: naming `name` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be a number of bytes (e.g. 1024 or '512M'), got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"{name} must be a number of bytes with an optional unit K, M, G or T (e.g. "
            f"'512M', '20G'), got {value!r}"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class FetchOptions:
    """How remote objects (URLs read through fsspec) are fetched.

    An object of `ranges_from_size` bytes or more is fetched as consecutive byte ranges of
    `range_size` bytes, `ranges_in_flight` at once (in threads), and delivered in order:
    an object store that caps each request's rate delivers about `ranges_in_flight` times
    more. Each range is retried on its own; no byte is fetched twice but by a retry.
    Smaller objects are fetched in ranges of the file system's block size, one at a time.
    Closing a stream (or dropping it) stops its threads at once: for ``s3://`` its requests
    in flight are cancelled and their connections closed, however slow the store; with
    other fsspec file systems each thread first finishes the request it is in.

    With `cache_dir`, every object read whole is kept there (keyed by its URL, size and
    ETag), and read from there while it is unchanged: the ranks of one host share it, and
    a second epoch makes no GET request. The least recently used objects are evicted to
    keep it under `cache_size` bytes.

    Give it as the storage option ``"infinibatch_like"`` (a `FetchOptions`, or a dict of
    some of its fields, the others from the environment), or set the environment
    variables ``INFINIBATCH_LIKE_RANGES_IN_FLIGHT``, ``INFINIBATCH_LIKE_RANGE_SIZE``,
    ``INFINIBATCH_LIKE_RANGES_FROM_SIZE``, ``INFINIBATCH_LIKE_CACHE_DIR`` and
    ``INFINIBATCH_LIKE_CACHE_SIZE`` (sizes in bytes, or with a unit: ``"20G"``).

    Args:
        ranges_in_flight: ranges fetched at once for a large object (>= 0; 0 fetches one
            range at a time, in the reading thread). Memory: up to this many ranges
            buffered, plus the one being read.
        range_size: bytes per range (>= 1). The sizes also take a str with a unit
            (``"8M"``), as in a dict or an environment variable.
        ranges_from_size: the size from which an object is fetched in concurrent ranges.
        cache_dir: the cache directory (created if missing), or None: no cache.
        cache_size: the most bytes of finished objects the cache holds (>= 1); an object
            larger than this is not cached.
    """

    ranges_in_flight: int = 8
    range_size: int = 8 << 20
    ranges_from_size: int = 16 << 20
    cache_dir: str | os.PathLike[str] | None = None
    cache_size: int = 10 << 30

    def __post_init__(self) -> None:
        set_field = object.__setattr__  # frozen: normalise once, here
        for name in ("range_size", "ranges_from_size", "cache_size"):
            set_field(self, name, parse_size(getattr(self, name), f"FetchOptions: {name}"))
        _require_count("ranges_in_flight", self.ranges_in_flight, 0)
        _require_count("range_size", self.range_size, 1)
        _require_count("ranges_from_size", self.ranges_from_size, 0)
        _require_count("cache_size", self.cache_size, 1)
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not os.fspath(
                self.cache_dir
            ):
                raise TypeError(
                    f"FetchOptions: cache_dir must be a path or None, got {self.cache_dir!r}"
                )
            set_field(self, "cache_dir", os.fspath(self.cache_dir))

    @classmethod
    def from_environment(cls) -> FetchOptions:
        """The defaults, with each field whose environment variable is set taken from it.

        Raises:
            ValueError: naming the variable, for a value that is not valid.
        """
        given: dict[str, Any] = {}
        for field, variable in ENVIRONMENT.items():
            value = os.environ.get(variable)
            if value is None or value == "":
                continue
            if field == "ranges_in_flight":
                if not value.strip().isdigit():
                    raise ValueError(f"{variable} must be an int >= 0, got {value!r}")
                given[field] = int(value)
            elif field == "cache_dir":
                given[field] = value
            else:
                given[field] = parse_size(value, variable)
        return cls(**given)


def _require_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"FetchOptions: {name} must be an int >= {least}, got {value!r}")
