"""The garbage collector of worker processes: what `set_worker_gc` sets, and what a worker
does with it when it starts.

A data pipeline makes containers at a high rate (a token list per line, a list per batch)
and holds thousands of them for a while (read-ahead, shuffle buffers), yet almost never
makes reference cycles: reference counting frees nearly everything. With CPython's
default first-generation threshold of 700, a collection runs every 700 net new containers
and walks every young container's items, so each container held in a read-ahead of
10,000 lines is walked many times over: 11 to 15 % of the CPU time of the P1 benchmark
pipeline. A threshold above a pipeline's working set makes collections rare, and each
walks a container about once; cycles are still collected, at most `threshold` containers
after they were made.

Freezing (`gc.freeze`) what a worker holds when it starts (the parent's objects inherited
by fork, the imported modules) keeps collections from walking them at all, and so from
writing to the pages a forked worker shares with its parent.
"""

from __future__ import annotations

import gc
from typing import NamedTuple


class WorkerGC(NamedTuple):
    """The collector settings of worker processes (see `set_worker_gc`)."""

    threshold: int | None
    freeze: bool


DEFAULT = WorkerGC(threshold=50_000, freeze=True)

_current = DEFAULT


def set_worker_gc(threshold: int | None = DEFAULT.threshold, *, freeze: bool = True) -> None:
    """Set the garbage collector of the worker processes started from now on, by every
    background stage (process `PrefetchIterator` and `ParallelMapIterator`,
    `ShardedIterator` workers, chunk read-ahead in processes); this process's own
    collector is left alone.

    Args:
        threshold: the first-generation threshold of the workers' collector (Python's
            default is 700): containers made, net of those freed, between two
            collections. The default, 50,000, spares streaming pipelines most of their
            collections; a worker then holds at most that many containers of cyclic
            garbage before it is freed. None: keep the threshold the worker starts with.
        freeze: move everything a worker holds when it starts (what it inherited from
            its parent, its imports) to the collector's permanent generation
            (`gc.freeze`), so that collections never walk it.

    ``set_worker_gc(None, freeze=False)`` leaves the workers' collector as Python sets it.
    """
    global _current
    if threshold is not None and (type(threshold) is not int or threshold < 1):
        raise ValueError(f"set_worker_gc: threshold must be an int >= 1 or None, got {threshold!r}")
    if type(freeze) is not bool:
        raise TypeError(f"set_worker_gc: freeze must be a bool, got {freeze!r}")
    _current = WorkerGC(threshold, freeze)


def worker_gc() -> WorkerGC:
    """The settings a worker process started now gets."""
    return _current


def apply(settings: WorkerGC) -> None:
    """Set this (worker) process's collector to `settings`."""
    if settings.freeze:
        gc.freeze()
    if settings.threshold is not None:
        gc.set_threshold(settings.threshold, *gc.get_threshold()[1:])
