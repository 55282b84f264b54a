"""Flattening: one input item becomes many output items."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from ._base import (
    CheckpointableIterator,
    Stage,
    State,
    fast_iterator,
    require_callable,
    require_checkpointable,
    skip_items,
)


class SelectManyIterator(Stage[Any]):
    """Yields the items of ``collection_selector(item)`` (or of ``item`` itself) for each
    item of the source, in order: a flat-map.

    Args:
        source_iterator: the source; it is reset.
        collection_selector: maps a source item to an iterable, e.g. a chunk file name to
            its lines. None iterates over each item.

    Checkpoint:
        ``{"source", "consumed"}``: the source's state before the current item, and how
        many of its collection's items were yielded. A restore takes that item from the
        source again, calls the selector again (re-reading one chunk) and skips
        `consumed` items.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "source": dict,
        "consumed": int,
    }

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        collection_selector: Callable[[Any], Iterable[Any]] | None = None,
    ) -> None:
        require_checkpointable("SelectManyIterator", "source_iterator", source_iterator)
        if collection_selector is not None:
            require_callable("SelectManyIterator", "collection_selector", collection_selector)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._selector = collection_selector
        self._restore(None)

    def _state(self) -> State:
        return {"source": self._anchor, "consumed": self._consumed}

    def _restore(self, state: State | None) -> None:
        if state is None:
            self.restore_source(self._source, None, "source")
            self._anchor, self._consumed = self._source.getstate(), 0
        else:
            self.restore_source(self._source, state["source"], "source")
            self._anchor, self._consumed = state["source"], state["consumed"]
        if self._consumed < 0:
            raise self.mismatch(f"'consumed' must be >= 0, got {self._consumed}")
        self._iterator = self._generate(self._consumed)

    def _collection(self, item: Any) -> Iterator[Any]:
        return iter(item if self._selector is None else self._selector(item))

    def _generate(self, skip: int) -> Iterator[Any]:
        source = self._source
        pull = fast_iterator(source)
        if skip:
            try:
                outer = next(pull)
            except StopIteration:
                raise self.mismatch(
                    f"the checkpoint is inside a collection ({skip} items consumed), "
                    "but the source is exhausted"
                ) from None
            inner = self._collection(outer)
            skip_items(self, inner, skip, "the current collection")
            for self._consumed, item in enumerate(inner, skip + 1):
                yield item
        while True:
            self._anchor = source.getstate()
            self._consumed = 0
            try:
                outer = next(pull)
            except StopIteration:
                return
            collection = self._collection(outer)
            for self._consumed, item in enumerate(collection, 1):
                yield item
