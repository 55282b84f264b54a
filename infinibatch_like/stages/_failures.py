"""How failures become `BadRecord`s where they happen, for the bad-record filter of
`infinibatch_like.stages.bad_records.BudgetedStage`: `Guarded` transforms (run by the
workers of a `ParallelMapIterator`) and `tolerant` chunk readers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from .._core.protocol import SkippableIterator

MESSAGE_LIMIT = 200
"""Ledger entries keep error messages and chunk names up to this many characters."""


class BadRecord(NamedTuple):
    """Stands in for an item whose transform raised (see `Guarded`), or a record whose
    reading raised (see `tolerant`)."""

    error_type: str
    message: str
    kind: str = "item"
    """``"item"``, ``"record"`` or ``"chunk"``, as in `SkipLedger`."""
    error: BaseException | None = None
    """The error itself, in the process that caught it (a pickle leaves it out)."""

    def __reduce__(self) -> tuple[type[BadRecord], tuple[str, str, str]]:
        return BadRecord, (self.error_type, self.message, self.kind)


def failure(error: BaseException, kind: str = "item") -> BadRecord:
    """`error` as a `BadRecord` (its type and message as plain strings, which also cross
    process boundaries)."""
    message = str(error)
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return BadRecord(type(error).__qualname__, message, kind, error)


class Guarded:
    """`transform`, returning a `BadRecord` for an item it raises an Exception on (a
    picklable callable: the workers of a `ParallelMapIterator` run it too)."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, item: Any) -> Any:
        try:
            return self.transform(item)
        except Exception as error:
            return failure(error)

    def __repr__(self) -> str:
        return repr(self.transform)


class _Tolerant(SkippableIterator[Any]):
    """See `tolerant`."""

    def __init__(self, items: Iterator[Any], longest_run: int) -> None:
        self._items, self._longest_run, self._in_a_row = items, longest_run, 0
        self._ahead: Any = _FIRST
        """A record read ahead, `_FIRST` before the first one, else _MISSING."""

    def __next__(self) -> Any:
        if self._ahead is not _MISSING:
            return self._take_ahead()
        if self._in_a_row >= self._longest_run:
            raise StopIteration
        try:
            item = next(self._items)
        except StopIteration:
            self._in_a_row = self._longest_run  # ended: sticky
            raise
        except Exception as error:
            self._in_a_row += 1
            return failure(error, "record")
        self._in_a_row = 0
        return item

    def _take_ahead(self) -> Any:
        """The record read ahead, or the first one: a failed first record with nothing
        after it is the chunk's failure (to know, the next record is read ahead)."""
        ahead, self._ahead = self._ahead, _MISSING
        if ahead is not _FIRST:
            return ahead
        first = next(self, _MISSING)
        if first is _MISSING:
            raise StopIteration
        if type(first) is BadRecord:
            following = next(self, _MISSING)
            if following is _MISSING:
                return first._replace(kind="chunk")
            self._ahead = following
        return first

    def skip(self, count: int) -> int:
        items = self._items
        if isinstance(items, SkippableIterator):  # each failed record counts as one there
            skipped = items.skip(count)
            if skipped:
                self._ahead = _MISSING  # the next record is not the first one
            return skipped
        skipped = 0
        while skipped < count and next(self, _MISSING) is not _MISSING:
            skipped += 1
        return skipped


_MISSING: Any = object()
_FIRST: Any = object()


def tolerant(items: Iterator[Any], longest_run: int) -> Iterator[Any]:
    """The records of `items` (a chunk), with a `BadRecord` in place of each record whose
    ``next()`` raised, as long as the iterator goes on after an error (a generator does
    not): a ``"record"``, or the ``"chunk"`` where its first record failed and nothing
    follows. Stops after `longest_run` failures in a row, so that an iterator failing
    forever ends. A `SkippableIterator` stays one (skip before reading): skipping passes
    over its failed records as well."""
    return _Tolerant(items, longest_run)
