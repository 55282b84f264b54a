"""Flattening: one input item becomes many output items, optionally read ahead in threads."""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, ClassVar

from ._base import (
    CheckpointableIterator,
    Stage,
    State,
    fast_iterator,
    require_callable,
    require_checkpointable,
    require_int,
    skip_items,
    source_state,
)

Selector = Callable[[Any], Iterable[Any]]


def _select(selector: Selector | None, item: Any) -> Iterator[Any]:
    """``iter(selector(item))``, with a note naming the item when the selector fails."""
    if selector is None:
        return iter(item)
    try:
        return iter(selector(item))
    except Exception as error:
        if sys.version_info >= (3, 11):
            error.add_note(f"(raised by SelectManyIterator's collection_selector on {item!r})")
        raise


class _Read:
    """``list(_select(selector, item))`` computed in a daemon thread; `result` waits for it.

    zlib, file and network reads release the GIL, so reading and decompressing the next
    chunks overlaps with the consumer's work."""

    def __init__(self, selector: Selector | None, item: Any) -> None:
        self._selector, self._item = selector, item
        self._items: list[Any] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="infinibatch_like.SelectManyIterator.reader", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._items = list(_select(self._selector, self._item))
        except BaseException as error:
            self._error = error

    def result(self) -> Iterator[Any]:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return iter(self._items)

    def wait(self) -> None:
        self._thread.join()


class SelectManyIterator(Stage[Any]):
    """Yields the items of ``collection_selector(item)`` (or of ``item`` itself) for each
    item of the source, in order: a flat-map.

    With ``read_ahead=n`` the next `n` collections are read in background threads (one
    thread each, named ``infinibatch_like.SelectManyIterator.reader``) while the consumer
    works through the current one, e.g. reading and decompressing the next chunk files.
    Each such collection is materialized as a list, so up to ``n + 1`` are held in memory;
    the selector must be thread-safe. The output and the states are the same as without
    read-ahead.

    Args:
        source_iterator: the source; it is reset.
        collection_selector: maps a source item to an iterable, e.g. a chunk file name to
            its lines. None iterates over each item.
        read_ahead: how many collections to read ahead in threads (>= 0; 0 reads each one
            when the consumer reaches it).

    Raises:
        Exception: whatever the selector raises, when the consumer reaches that
            collection, with a note naming the source item (the chunk).

    Checkpoint:
        ``{"source", "consumed"}``: the source's state before the current item, and how
        many of its collection's items were yielded. A restore takes that item from the
        source again, calls the selector again (re-reading one chunk) and skips
        `consumed` items. Collections read ahead are not part of the state.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "source": dict,
        "consumed": int,
    }

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        collection_selector: Selector | None = None,
        *,
        read_ahead: int = 0,
    ) -> None:
        require_checkpointable("SelectManyIterator", "source_iterator", source_iterator)
        if collection_selector is not None:
            require_callable("SelectManyIterator", "collection_selector", collection_selector)
        self._read_ahead = require_int("SelectManyIterator", "read_ahead", read_ahead, 0)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._selector = collection_selector
        self._restore(None)

    def _state(self) -> State:
        return {"source": self._anchor, "consumed": self._consumed}

    def _restore(self, state: State | None) -> None:
        if state is None:
            self.restore_source(self._source, None, "source")
            self._anchor, self._consumed = source_state(self._source), 0
        else:
            self.restore_source(self._source, state["source"], "source")
            self._anchor, self._consumed = state["source"], state["consumed"]
        if self._consumed < 0:
            raise self.mismatch(f"'consumed' must be >= 0, got {self._consumed}")
        collections = self._read_now() if self._read_ahead == 0 else self._read_early()
        self._iterator = self._generate(collections, self._consumed)

    def _read_now(self) -> Iterator[tuple[State, Callable[[], Iterator[Any]]]]:
        """(source state before the item, how to get its collection) for each source item."""
        source, selector = self._source, self._selector
        pull = fast_iterator(source)
        while True:
            anchor = source_state(source)
            try:
                item = next(pull)
            except StopIteration:
                return
            yield anchor, partial(_select, selector, item)

    def _read_early(self) -> Iterator[tuple[State, Callable[[], Iterator[Any]]]]:
        """As `_read_now`, with the next `read_ahead` collections read in threads."""
        source, selector = self._source, self._selector
        pull = fast_iterator(source)
        pending: deque[tuple[State, _Read]] = deque()
        exhausted = False
        failure: Exception | None = None  # the source's, raised where it happened
        try:
            while True:
                while not exhausted and len(pending) <= self._read_ahead:
                    anchor = source_state(source)
                    try:
                        item = next(pull)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as error:
                        exhausted, failure = True, error
                        break
                    pending.append((anchor, _Read(selector, item)))
                if not pending:
                    if failure is not None:
                        raise failure
                    return
                anchor, read = pending.popleft()
                yield anchor, read.result
        finally:
            for _, read in pending:  # no reader thread outlives the stage's iteration
                read.wait()

    def _generate(
        self, collections: Iterator[tuple[State, Callable[[], Iterator[Any]]]], skip: int
    ) -> Iterator[Any]:
        if skip:
            try:
                self._anchor, collection = next(collections)
            except StopIteration:
                raise self.mismatch(
                    f"the checkpoint is inside a collection ({skip} items consumed), "
                    "but the source is exhausted"
                ) from None
            inner = collection()
            skip_items(self, inner, skip, "the current collection")
            for self._consumed, item in enumerate(inner, skip + 1):
                yield item
        for self._anchor, collection in collections:
            self._consumed = 0
            for self._consumed, item in enumerate(collection(), 1):
                yield item
        self._anchor, self._consumed = source_state(self._source), 0
