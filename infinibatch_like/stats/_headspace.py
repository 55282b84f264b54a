"""Headspace: how fast the pipeline delivers alone, and how fast the consumer steps alone."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from itertools import cycle, islice
from typing import Any, NamedTuple

from .._core.checks import require_callable, require_int
from .._core.protocol import CheckpointableIterator


class Rate(NamedTuple):
    """`items` items (or steps) in `seconds`; `kept`: items kept for `consumer_rate`."""

    items: int
    seconds: float
    kept: list[Any]

    @property
    def per_s(self) -> float:
        """Items (or steps) per second."""
        return self.items / self.seconds if self.seconds > 0 else float("inf")


def headspace(
    source: CheckpointableIterator[Any] | Callable[[], CheckpointableIterator[Any]],
    items: int,
    *,
    keep: int = 0,
) -> Rate:
    """How fast the pipeline delivers when the consumer takes no time: `items` items drained
    from a copy, timed. The copy is built by `source` (a factory: from its start) or, for a
    pipeline, is a copy of it at its current position (pickled and restored from its
    state; closures need cloudpickle); the given pipeline is neither advanced nor changed.
    The first `keep` items are returned in `kept`, to replay through the training step
    with `consumer_rate`. The copy is closed afterwards.

    Fewer than `items` are counted if the stream ends sooner.
    """
    require_int("stats.headspace", "items", items, 1)
    require_int("stats.headspace", "keep", keep, 0)
    copy = _copy(source)
    try:
        start = time.perf_counter()
        kept = list(islice(copy, keep))
        count = len(kept) + sum(1 for _ in islice(copy, max(0, items - len(kept))))
        seconds = time.perf_counter() - start
    finally:
        copy.close()
    return Rate(count, seconds, kept)


def _copy(
    source: CheckpointableIterator[Any] | Callable[[], CheckpointableIterator[Any]],
) -> CheckpointableIterator[Any]:
    if not isinstance(source, CheckpointableIterator):
        require_callable("stats.headspace", "source", source)
        built = source()
        if not isinstance(built, CheckpointableIterator):
            raise TypeError(
                "stats.headspace: source() must return a CheckpointableIterator, got "
                f"{type(built).__name__}"
            )
        return built
    try:
        data = pickle.dumps(source)
    except Exception as error:
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"stats.headspace: cannot copy the pipeline ({error}); pass a function that "
                "builds it instead, or install infinibatch_like[parallel] (cloudpickle)"
            ) from error
        data = cloudpickle.dumps(source)
    copy: CheckpointableIterator[Any] = pickle.loads(data)
    return copy


def consumer_rate(step: Callable[[Any], object], batches: Sequence[Any], steps: int) -> Rate:
    """How fast the consumer goes when data is free: `steps` calls of ``step(batch)``
    cycling over `batches` (e.g. ``headspace(..., keep=n).kept``), timed."""
    require_callable("stats.consumer_rate", "step", step)
    require_int("stats.consumer_rate", "steps", steps, 1)
    if not batches:
        raise ValueError("stats.consumer_rate: batches is empty; keep some with headspace(keep=n)")
    start = time.perf_counter()
    for batch in islice(cycle(batches), steps):
        step(batch)
    return Rate(steps, time.perf_counter() - start, [])
