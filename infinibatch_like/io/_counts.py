"""What this process fetched from object stores and from the local cache: `storage_counts`."""

from __future__ import annotations

import threading
from collections import Counter

from .retry import retry_counts

COUNTS = ("requests", "bytes", "cache_hits", "cache_misses", "cache_evicted")
_lock = threading.Lock()
_counts: Counter[str] = Counter()
_workers: Counter[str] = Counter()
"""What worker processes of this process's pipelines reported reading (`add_worker_reads`)."""


def count(name: str, amount: int = 1) -> None:
    with _lock:
        _counts[name] += amount


def storage_counts() -> dict[str, int]:
    """What this process read from object stores since it started (or since
    `reset_storage_counts`):

    - ``requests``: GET requests of object data (each range, each retry of one);
    - ``bytes``: the bytes they brought;
    - ``cache_hits``, ``cache_misses``: objects opened from the local cache, and objects
      fetched from the store because it did not hold them (with a cache configured);
    - ``cache_evicted``: objects this process removed from the cache to make room.

    Metadata requests (the HEAD that finds an object's size and ETag) are not counted.
    Worker processes (e.g. DataLoader workers) count their own; those of the library's
    process-mode stages report theirs to statistics (`worker_reads`).
    """
    with _lock:
        return {name: _counts[name] for name in COUNTS}


def reset_storage_counts() -> None:
    """Set every count of `storage_counts` back to zero."""
    with _lock:
        _counts.clear()


def reads_now() -> dict[str, int]:
    """`storage_counts` and ``retries`` (the sum of `retry_counts`): what statistics report
    of this process's reads."""
    return {**storage_counts(), "retries": sum(retry_counts().values())}


def add_worker_reads(reads: dict[str, int]) -> None:
    """Add what a worker process of one of this process's stages read (a `ReadsSince`
    delta, sent with its statistics)."""
    with _lock:
        _workers.update(reads)


def worker_reads() -> dict[str, int]:
    """What worker processes reported reading (`add_worker_reads`), by `reads_now`'s keys."""
    with _lock:
        return {name: _workers[name] for name in (*COUNTS, "retries")}


class ReadsSince:
    """In a worker process: its reads since the previous `delta` (the first since it was
    made: a forked worker starts from its parent's counts)."""

    def __init__(self) -> None:
        self._sent = reads_now()

    def delta(self) -> dict[str, int]:
        now = reads_now()
        delta = {name: value - self._sent.get(name, 0) for name, value in now.items()}
        self._sent = now
        return {name: value for name, value in delta.items() if value}
