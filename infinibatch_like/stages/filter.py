"""Keeping the items for which a predicate holds (`FilterIterator`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

from .._core.checks import require_callable, require_checkpointable
from .._core.protocol import CheckpointableIterator, State
from .._core.stage import Stage, fast_iterator, source_state, state_before_last

T = TypeVar("T")


class FilterIterator(Stage[T]):
    """Yields the items of the source for which ``predicate(item)`` is true, in order.

    The same stream as ``SelectManyIterator(source, lambda x: [x] if predicate(x) else [])``,
    at the cost of one call of `predicate` per item (it runs as a builtin ``filter``).

    Args:
        source_iterator: the source.
        predicate: called on each item; the item is kept when the result is true.

    Raises:
        Exception: whatever `predicate` raises, with a note naming this stage, the
            predicate and the item.

    Checkpoint:
        ``{"source"}``: the source's state, taken right after the last item kept (the
        items dropped before it are behind it); nothing is re-read on restore, and the
        state is as small as the source's. After an error in `predicate`, the state steps
        the source back to the failing item where the source can step back one item (as
        for `MapIterator`), so that a restore calls the predicate on it again; over any
        other source `getstate` raises RuntimeError until the next `setstate`. Being
        only its source's, the state regroups above a `ShardedIterator` on another number
        of ranks (`infinibatch_like.distributed.restore_state`).
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"source": dict}
    _user_callables = ("predicate",)
    _loses_input_on_error = True
    _source_field = "source"
    _not_elastic = None  # its state is its source's: elastic over a ShardedIterator

    def __init__(
        self, source_iterator: CheckpointableIterator[T], predicate: Callable[[T], object]
    ) -> None:
        require_checkpointable("FilterIterator", "source_iterator", source_iterator)
        require_callable("FilterIterator", "predicate", predicate)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._predicate = predicate
        self._iterator = filter(predicate, fast_iterator(source_iterator))

    def _state(self) -> State:
        return {"source": source_state(self._source)}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._iterator = filter(self._predicate, fast_iterator(self._source))

    def _fields_after_lost_input(self) -> State:
        before = state_before_last(self._source)  # the item the predicate failed on
        if before is None:
            return super()._fields_after_lost_input()
        return {"source": before}

    def _state_before_last(self) -> State | None:
        # The source stopped right after the last item kept: one step back yields it again.
        before = state_before_last(self._source)
        return None if before is None else {"stage": self._name, "source": before}
