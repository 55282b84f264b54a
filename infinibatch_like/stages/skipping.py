"""Skipping data on purpose: ranges of a stream left out, remembered by checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_checkpointable, require_int
from .._core.names import short_repr
from .._core.protocol import CheckpointableIterator, State
from .._core.schema import Check, FieldSpec, Int, ListOf
from .._core.stage import Stage, fast_iterator, source_state
from .mapping import MapIterator

T = TypeVar("T")

logger = logging.getLogger("infinibatch_like")

KEEP_DONE = 32
"""How many finished ranges a `SkipIterator` state keeps, for the record."""


def _range_problem(pair: object, stage: object) -> str | None:
    """What is wrong with `pair` as a range ``[start, stop]`` of positions, or None."""
    if (
        isinstance(pair, list)
        and len(pair) == 2
        and all(type(value) is int for value in pair)
        and 0 <= pair[0] < pair[1]
    ):
        return None
    return f"must be a range [start, stop] with 0 <= start < stop, got {short_repr(pair)}"


class SkipIterator(Stage[T]):
    """Yields its source's items, leaving out the items at chosen positions.

    Positions count the source's items from the start of the run (0, 1, ...), skipped
    ones included, so they do not move when ranges are added. Put the stage where its
    positions mean what you count: after the batcher, position k is training step k (the
    k-th batch), e.g. to skip the batches around a loss spike. Ranges come from `skip`
    (e.g. from a config file, given again at each restart), from `skip_range` and from
    `skip_next` (fast-forward), and are kept in the state, so that a restore from a
    checkpoint taken after they were added skips them too.

    Skipped items are pulled from the source without being yielded, so the stages after
    this one never see them. Where the source is a chain of `MapIterator` stages (without
    an `on_error` policy), skipped items are pulled from below the chain: their
    transforms are not called (a plain map's state is its source's, so nothing else
    changes). Stages below that (reading, shuffling, batching) do their work for skipped
    items too: skipping never changes which items come later.

    Args:
        source_iterator: the source.
        skip: ranges ``(start, stop)`` of positions to skip (``start <= p < stop``),
            merged with those of a restored state; ranges already passed are ignored.

    Raises:
        TypeError, ValueError: for a bad range, naming it.

    Checkpoint:
        ``{"source", "position", "pending", "done", "skipped"}``: the source's state, the
        position, the ranges still to skip (``[[start, stop], ...]``), the last
        ``KEEP_DONE`` (32) ranges skipped and the number of items skipped. Small: the
        ranges given plus a constant; a restore re-reads nothing.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "position": Int(0),
        "pending": ListOf(Check(_range_problem)),
        "done": ListOf(Check(_range_problem)),
        "skipped": Int(0),
    }

    _pending: list[list[int]]
    _done: list[list[int]]
    _source: CheckpointableIterator[Any]

    def __init__(
        self, source_iterator: CheckpointableIterator[T], skip: Iterable[tuple[int, int]] = ()
    ) -> None:
        require_checkpointable("SkipIterator", "source_iterator", source_iterator)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._given = [self._checked_range("skip", pair) for pair in skip]
        self._restore(None)

    @property
    def position(self) -> int:
        """How many source items were passed (yielded or skipped) so far."""
        return self._position

    @property
    def pending(self) -> list[tuple[int, int]]:
        """The ranges still to skip, in order."""
        return [(start, stop) for start, stop in self._pending]

    @property
    def skipped(self) -> int:
        """How many items were skipped so far."""
        return self._skipped

    def skip_range(self, start: int, stop: int) -> None:
        """Skip the items at positions ``start <= p < stop`` (the part before the current
        position, already yielded, is ignored with a warning)."""
        start, stop = self._checked_range("skip_range", (start, stop))
        if stop <= self._position:
            raise ValueError(
                f"SkipIterator.skip_range: the range [{start}, {stop}) ends before the current "
                f"position {self._position}: those items were already yielded"
            )
        if start < self._position:
            logger.warning(
                "SkipIterator.skip_range: items %d..%d of [%d, %d) were already yielded; "
                "skipping from %d",
                start,
                self._position - 1,
                start,
                stop,
                self._position,
            )
        self._pending = _merged([*self._pending, [max(start, self._position), stop]])

    def skip_next(self, count: int) -> None:
        """Fast-forward: skip the next `count` items (added to the ranges of the state)."""
        require_int("SkipIterator.skip_next", "count", count, 0)
        if count:
            self.skip_range(self._position, self._position + count)

    def _checked_range(self, owner: str, pair: object) -> tuple[int, int]:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"SkipIterator: {owner} takes ranges (start, stop) of positions, got {pair!r}"
            )
        start = require_int(f"SkipIterator: {owner}", "start", pair[0], 0)
        stop = require_int(f"SkipIterator: {owner}", "stop", pair[1], 0)
        if stop <= start:
            raise ValueError(
                f"SkipIterator: {owner}: the range ({start}, {stop}) is empty; stop must be "
                "> start"
            )
        return start, stop

    def _state(self) -> State:
        return {
            "source": source_state(self._source),
            "position": self._position,
            "pending": [list(pair) for pair in self._pending],
            "done": [list(pair) for pair in self._done],
            "skipped": self._skipped,
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        if state is None:
            self._position, self._skipped, pending, self._done = 0, 0, [], []
        else:
            self._position, self._skipped = state["position"], state["skipped"]
            pending, self._done = state["pending"], state["done"]
            self._done = [list(pair) for pair in self._done[-KEEP_DONE:]]
        position = self._position
        given = [[max(start, position), stop] for start, stop in self._given if stop > position]
        self._pending = _merged([[max(a, position), b] for a, b in pending if b > position] + given)
        self._iterator = self._generate()

    def _generate(self) -> Iterator[T]:
        pull = fast_iterator(self._source)
        below: CheckpointableIterator[Any] = self._source
        while type(below) is MapIterator and below._budget is None:
            below = below._source  # skipped items need not be transformed
        fast = fast_iterator(below)
        while True:
            pending = self._pending
            if pending and pending[0][0] <= self._position:
                if not self._skip_front(fast):
                    return
                continue
            try:
                item = next(pull)
            except StopIteration:
                return
            self._position += 1
            yield item

    def _skip_front(self, fast: Iterator[Any]) -> bool:
        """Skip the first pending range; False if the source ended within it."""
        current = self._pending[0]
        start = current[0]
        while self._position < current[1]:
            try:
                next(fast)
            except StopIteration:
                current[0] = self._position
                return False
            self._position += 1
            self._skipped += 1
            current[0] = self._position
        self._pending.pop(0)
        self._done.append([start, current[1]])
        del self._done[:-KEEP_DONE]
        return True




def _merged(ranges: list[list[int]]) -> list[list[int]]:
    """`ranges` sorted, with overlapping and touching ones joined."""
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged
