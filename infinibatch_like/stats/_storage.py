"""The storage section of the statistics: what this process fetched from object stores."""

from __future__ import annotations

import weakref
from typing import Any

from ..io._counts import reads_now, worker_reads

_baselines: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()
"""The counts when statistics were switched on, per pipeline."""


def _now() -> dict[str, int]:
    here, workers = reads_now(), worker_reads()
    return {name: value + workers.get(name, 0) for name, value in here.items()}


def mark(pipeline: Any) -> None:
    """Count `pipeline`'s storage statistics from now (`enable` calls it)."""
    _baselines[pipeline] = _now()


def storage(pipeline: Any = None) -> dict[str, int]:
    """What this process and the worker processes of its process-mode stages (process
    `PrefetchIterator`, `ShardedIterator` workers) read from object stores since statistics
    were switched on for
    `pipeline` (or since the process started, or since the counts were reset, if None):
    the counts of `infinibatch_like.io.storage_counts` (``requests``, ``bytes``,
    ``cache_hits``, ``cache_misses``, ``cache_evicted``) and ``retries`` (the sum of
    `infinibatch_like.io.retry_counts`).

    The counts are the process's, whichever pipeline made the reads; a worker process
    reports its reads with its statistics (every second or so, and at its end), while a
    DataLoader worker and the transform of a process `ParallelMapIterator` count their own.
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
        f"storage (this process and its workers): {counts['requests']:,} GET requests, "
        f"{counts['bytes'] / 1e6:,.1f} MB fetched, {counts['retries']:,} retries; cache: "
        f"{counts['cache_hits']:,} hits, {counts['cache_misses']:,} misses, "
        f"{counts['cache_evicted']:,} evicted"
    )
