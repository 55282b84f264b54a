"""Combining several sources: zipping and index-controlled interleaving."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from .._core.checks import require_checkpointable
from .._core.protocol import CheckpointableIterator, State
from .._core.stage import Stage, fast_iterator, source_state


class ZipIterator(Stage[tuple[Any, ...]]):
    """Yields tuples of one item from each source; ends with the shortest source.

    The sources are not reset (as in infinibatch). When a source ends, the sources before
    it in the argument list have already given up one item, which is dropped.

    Checkpoint:
        ``{"sources"}``: the list of the sources' states. Nothing is re-read.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"sources": list}

    def __init__(self, *source_iterators: CheckpointableIterator[Any]) -> None:
        if not source_iterators:
            raise ValueError("ZipIterator: needs at least one source iterator")
        for index, source in enumerate(source_iterators):
            require_checkpointable("ZipIterator", f"source_iterators[{index}]", source)
        self._zipped = tuple(source_iterators)
        self._sources = self._zipped
        self._iterator = self._generate()

    def _state(self) -> State:
        return {"sources": [source_state(source) for source in self._zipped]}

    def _restore(self, state: State | None) -> None:
        self.restore_sources(self._zipped, None if state is None else state["sources"], "sources")
        self._iterator = self._generate()

    def _generate(self) -> Iterator[tuple[Any, ...]]:
        yield from zip(*(fast_iterator(source) for source in self._zipped), strict=False)


class MultiplexSourceExhaustedError(RuntimeError):
    """The control iterator of a MultiplexIterator chose a source that has ended."""


class MultiplexIterator(Stage[Any]):
    """For each index i from the control iterator, yields the next item of source i.

    Ends when the control iterator ends. All iterators are reset.

    Raises:
        MultiplexSourceExhaustedError: (a RuntimeError) when the chosen source has ended.
        ValueError: when the control iterator yields something that is not a valid index.

    Checkpoint:
        ``{"control", "sources"}``: the control iterator's state and the list of the
        sources' states. Nothing is re-read.
    """

    _not_elastic = "its position belongs to this rank's sources"
    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "control": dict,
        "sources": list,
    }

    def __init__(
        self,
        control_iterator: CheckpointableIterator[int],
        source_iterators: Sequence[CheckpointableIterator[Any]],
    ) -> None:
        require_checkpointable("MultiplexIterator", "control_iterator", control_iterator)
        for index, source in enumerate(source_iterators):
            require_checkpointable("MultiplexIterator", f"source_iterators[{index}]", source)
        self._control = control_iterator
        self._choices = tuple(source_iterators)
        self._sources = (control_iterator, *self._choices)
        self._restore(None)

    def _state(self) -> State:
        return {
            "control": source_state(self._control),
            "sources": [source_state(source) for source in self._choices],
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._control, None if state is None else state["control"])
        self.restore_sources(self._choices, None if state is None else state["sources"], "sources")
        self._iterator = self._generate()

    def _generate(self) -> Iterator[Any]:
        pulls = [fast_iterator(source) for source in self._choices]
        count = len(pulls)
        for position, index in enumerate(fast_iterator(self._control)):
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
                raise ValueError(
                    f"MultiplexIterator: the control iterator yielded {index!r} at position "
                    f"{position}; expected an int in range({count})"
                )
            try:
                item = next(pulls[index])
            except StopIteration:
                raise MultiplexSourceExhaustedError(
                    f"MultiplexIterator: source_iterators[{index}] is exhausted (chosen by "
                    f"the control iterator at position {position})"
                ) from None
            yield item
