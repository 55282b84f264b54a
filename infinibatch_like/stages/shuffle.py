"""Shuffling streams that do not fit in memory: block-wise and through a random buffer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_checkpointable, require_int
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import (
    MARK_FIELDS,
    CountingRandom,
    Seed,
    adopt_seed,
    mark_fields,
    read_mark,
    resolve_seed,
)
from .._core.schema import FieldSpec
from .._core.stage import Stage, fast_iterator, source_state
from ._readahead import ReadAheadStage

T = TypeVar("T")


class BlockwiseShuffleIterator(ReadAheadStage[T]):
    """Cuts the source into consecutive blocks of `block_size` items and yields each block
    shuffled (one continuing ``random.Random(seed)`` shuffles them all).

    10 items, block 4, seed 0 give 2, 0, 1, 3, 4, 5, 7, 6, 8, 9. An item moves at most
    ``block_size - 1`` places; memory holds one block.

    Args:
        source_iterator: the source; it is reset.
        block_size: items per block, >= 1.
        seed: seed of the shuffles; None draws one (kept in checkpoints).

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "emitted", "fingerprint"}``: the source's
        state at the start of the current block, the generator's position before shuffling
        it and how many of its items were yielded, and `block_size`, which cannot change
        at a restart. No items; a restore re-reads the current block from the source.
    """

    _not_elastic = "its block holds this rank's items"

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        block_size: int,
        seed: Seed | None = 0,
    ) -> None:
        self._block_size = require_int("BlockwiseShuffleIterator", "block_size", block_size, 1)
        self._init_read_ahead(source_iterator, seed)
        self._restore(None)

    def _arguments(self) -> State:
        return {"block_size": self._block_size}

    @property
    def _most_outputs(self) -> int:
        return self._block_size

    def _next_group(self, pull: Iterator[T], rng: CountingRandom) -> tuple[list[T], bool]:
        block = list(islice(pull, self._block_size))
        rng.shuffle(block)
        return block, not block


class BufferedShuffleIterator(Stage[T]):
    """Shuffles through a buffer of `buffer_size` slots: each new item goes into a random
    slot (``randrange(buffer_size)`` of one ``random.Random(seed)``) and the slot's
    previous item, if any, is yielded. When the source ends, the remaining items are
    yielded from the last slot to the first.

    Unlike infinibatch, None items are kept (infinibatch uses None for an empty slot and
    drops them); otherwise the order is infinibatch's.

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "buffer", "empty", "fingerprint"}``: the
        source's state, the generator's position and the buffer itself: the items in the
        slots (lists and dicts in them are copied; for JSON checkpoints the items must be
        plain data) and the indices of the empty slots; and `buffer_size`, which cannot
        change at a restart. The state grows with `buffer_size`, not with the position; a
        restore re-reads nothing.
    """

    _not_elastic = "its buffer holds this rank's items"
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "seed": (int, str),
        **MARK_FIELDS,
        "buffer": list,
        "empty": list,
    }

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        buffer_size: int,
        seed: Seed | None = 0,
    ) -> None:
        require_checkpointable("BufferedShuffleIterator", "source_iterator", source_iterator)
        self._size = require_int("BufferedShuffleIterator", "buffer_size", buffer_size, 1)
        self._seed, self._seed_drawn = resolve_seed("BufferedShuffleIterator", seed)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._restore(None)

    def _arguments(self) -> State:
        return {"buffer_size": self._size}

    @staticmethod
    def _held_items_as(state: State, convert: Callable[[Any], Any]) -> State:
        """`state` with `convert` applied to the items its buffer holds (lineage's traced
        twin takes them as of unknown origin)."""
        empty = state.get("empty")
        skip = {index for index in empty if type(index) is int} if type(empty) is list else set()
        buffer = state.get("buffer")
        if type(buffer) is not list:
            return state
        items = [item if index in skip else convert(item) for index, item in enumerate(buffer)]
        return {**state, "buffer": items}

    def _state(self) -> State:
        buffer = self._buffer
        empty = [index for index, item in enumerate(buffer) if item is _EMPTY]
        items = list(buffer)
        for index in empty:
            items[index] = None
        return {
            "source": source_state(self._source),
            "seed": self._seed,
            **mark_fields(self._rng.mark()),
            "buffer": items,
            "empty": empty,
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        if state is None:
            self._buffer: list[Any] = [_EMPTY] * self._size
            self._rng = CountingRandom(self._seed)
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            buffer, empty = list(state["buffer"]), state["empty"]
            if len(buffer) > self._size:
                raise self.mismatch(
                    f"the checkpoint's buffer holds {len(buffer)} slots, this stage has "
                    f"{self._size}"
                )
            previous = -1
            for index in empty:  # increasing indices of slots that hold None
                if type(index) is not int or not previous < index < len(buffer):
                    raise self.mismatch(f"'empty' must list slots in increasing order: {empty!r}")
                if buffer[index] is not None:
                    raise self.mismatch(f"slot {index} is listed as empty but holds an item")
                buffer[index], previous = _EMPTY, index
            mark = read_mark(self, state["draws"], state["generator"])
            self._buffer = buffer
            self._rng = CountingRandom.from_mark(self._seed, mark)
        self._iterator = self._generate()

    def _generate(self) -> Iterator[T]:
        buffer, size = self._buffer, self._size
        below = self._rng.below
        # A buffer shorter than `size` comes from a checkpoint taken while emptying it,
        # after the source ended.
        source_items = fast_iterator(self._source) if len(buffer) == size else iter(())
        for item in source_items:
            index = below(size)
            previous = buffer[index]
            buffer[index] = item
            if previous is not _EMPTY:
                yield previous
        while buffer:
            previous = buffer.pop()
            if previous is not _EMPTY:
                yield previous


class _Empty:
    """Marks an empty buffer slot (None is a valid item)."""

    def __repr__(self) -> str:
        return "<empty slot>"


_EMPTY: Any = _Empty()
