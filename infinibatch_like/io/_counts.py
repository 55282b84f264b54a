"""What this process fetched from object stores and from the local cache: `storage_counts`."""

from __future__ import annotations

import threading
from collections import Counter

COUNTS = ("requests", "bytes", "cache_hits", "cache_misses", "cache_evicted")
_lock = threading.Lock()
_counts: Counter[str] = Counter()


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
    Worker processes (e.g. DataLoader workers) count their own.
    """
    with _lock:
        return {name: _counts[name] for name in COUNTS}


def reset_storage_counts() -> None:
    """Set every count of `storage_counts` back to zero."""
    with _lock:
        _counts.clear()
