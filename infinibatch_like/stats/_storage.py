"""The storage section of the statistics: what this process fetched from object stores."""

from __future__ import annotations

import weakref
from typing import Any

from ..io import retry_counts, storage_counts

_baselines: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
"""The counts when statistics were switched on, per pipeline."""


def _now() -> dict[str, int]:
    return {**storage_counts(), "retries": sum(retry_counts().values())}


def mark(pipeline: Any) -> None:
    """Count `pipeline`'s storage statistics from now (`enable` calls it)."""
    _baselines[pipeline] = _now()


def storage(pipeline: Any = None) -> dict[str, int]:
    """What this process read from object stores since statistics were switched on for
    `pipeline` (or since the process started, or since the counts were reset, if None):
    the counts of `infinibatch_like.io.storage_counts` (``requests``, ``bytes``,
    ``cache_hits``, ``cache_misses``, ``cache_evicted``) and ``retries`` (the sum of
    `infinibatch_like.io.retry_counts`).

    The counts are the process's, whichever pipeline made the reads; a DataLoader worker
    or a process-mode background stage counts its own.
    """
    now = _now()
    before = _baselines.get(pipeline, {}) if pipeline is not None else {}
    return {name: max(0, value - before.get(name, 0)) for name, value in now.items()}


def storage_line(counts: dict[str, int]) -> str | None:
    """The line of `report` for `counts` (a `storage` result), or None if nothing was read
    from an object store or its cache."""
    if not any(counts.values()):
        return None
    return (
        f"storage (this process): {counts['requests']:,} GET requests, "
        f"{counts['bytes'] / 1e6:,.1f} MB fetched, {counts['retries']:,} retries; cache: "
        f"{counts['cache_hits']:,} hits, {counts['cache_misses']:,} misses, "
        f"{counts['cache_evicted']:,} evicted"
    )
