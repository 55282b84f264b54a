"""Batching: fixed-size batches and bucketed batches of similar items with dynamic sizes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_callable, require_checkpointable, require_int
from .._core.fingerprint import described
from .._core.notes import lost_input
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import CountingRandom, Seed
from .._core.stage import Stage, fast_iterator, source_state
from ._readahead import ReadAheadStage

T = TypeVar("T")


class FixedBatchIterator(Stage[list[T]]):
    """Yields lists of `batch_size` consecutive items; the last one may be shorter.

    Checkpoint:
        ``{"source", "fingerprint"}``: the source's state at the start of the next batch,
        and `batch_size`, which cannot change at a restart. Nothing is re-read. After an
        error that interrupts a batch, `getstate` raises RuntimeError (the batch's first
        items are consumed and not yielded): restore a checkpoint taken before the error.
    """

    _not_elastic = "a batch in progress holds this rank's items"
    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"source": dict}

    def __init__(self, source_iterator: CheckpointableIterator[T], batch_size: int) -> None:
        require_checkpointable("FixedBatchIterator", "source_iterator", source_iterator)
        self._batch_size = require_int("FixedBatchIterator", "batch_size", batch_size, 1)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._restore(None)

    def _arguments(self) -> State:
        return {"batch_size": self._batch_size}

    def _state(self) -> State:
        return {"source": source_state(self._source)}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._iterator = self._generate()

    def _generate(self) -> Iterator[list[T]]:
        pull, size = fast_iterator(self._source), self._batch_size
        while True:
            batch: list[T] = []
            try:
                batch.extend(islice(pull, size))
            except Exception as error:
                if batch:  # taken from the source, never yielded: no state can give them
                    self._lost_input = lost_input(
                        f"FixedBatchIterator: {type(error).__name__} interrupted a batch after "
                        f"{len(batch)} items, which the source has given and a restore would "
                        "skip"
                    )
                raise
            if not batch:
                return
            yield batch


BatchSize = int | Callable[[Any], int]


class BucketedReadaheadBatchIterator(ReadAheadStage[list[T]]):
    """Reads `read_ahead` items at a time, sorts them by `key` (descending, stable) and cuts
    them into batches, whose order is then shuffled.

    Batches are cut greedily: a new batch starts when the current one is full, or, with
    `boundary_key`, when the boundary key of the next item differs from the previous
    item's. An int `batch_size` is fixed; a callable is called with the first (largest)
    item of each new batch and returns that batch's capacity (below 1 counts as 1). A
    short last read-ahead window is batched too; then iteration ends.

    Args:
        source_iterator: the source; it is reset.
        read_ahead: items per window, >= 1.
        key: sort key (batches hold items of similar key); None keeps the source order.
        batch_size: int >= 1, or a callable as above.
        boundary_key: optional; items with different boundary keys never share a batch.
        shuffle: shuffle each window's batches with one continuing ``Random(seed)``.
        seed: the seed; None draws one (kept in checkpoints).

    Raises:
        Exception: whatever `key`, `batch_size` or `boundary_key` raises, with a note
            naming the parameter and the item; the state still points at the window, so
            a restore re-reads it and raises at the same place.

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "emitted", "fingerprint"}``: the source's
        state at the start of the current window, the generator's position before
        shuffling its batches and how many of them were yielded, and the arguments that
        decide the batches, which cannot change at a restart: `read_ahead`, `batch_size`
        (an int, or ``"callable"``), whether `key` and `boundary_key` are given, and
        `shuffle`. No items; a restore re-reads the current window from the source.
    """

    _not_elastic = "its read-ahead holds this rank's items"
    _user_callables = ("key", "batch_size", "boundary_key")

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        read_ahead: int,
        key: Callable[[Any], Any] | None,
        batch_size: BatchSize,
        boundary_key: Callable[[Any], Any] | None = None,
        shuffle: bool = True,
        seed: Seed | None = 0,
    ) -> None:
        owner = "BucketedReadaheadBatchIterator"
        self._read_ahead = require_int(owner, "read_ahead", read_ahead, 1)
        if key is not None:
            require_callable(owner, "key", key)
        if isinstance(batch_size, int):
            require_int(owner, "batch_size", batch_size, 1)
        else:
            require_callable(owner, "batch_size", batch_size)
        if boundary_key is not None:
            require_callable(owner, "boundary_key", boundary_key)
        self._key, self._batch_size, self._boundary_key = key, batch_size, boundary_key
        self._shuffle = bool(shuffle)
        self._init_read_ahead(source_iterator, seed)
        self._restore(None)

    def _arguments(self) -> State:
        return {
            "read_ahead": self._read_ahead,
            "key": described(self._key),
            "batch_size": self._batch_size if isinstance(self._batch_size, int) else "callable",
            "boundary_key": described(self._boundary_key),
            "shuffle": self._shuffle,
        }

    @property
    def _most_outputs(self) -> int:
        return self._read_ahead

    def _next_group(self, pull: Iterator[T], rng: CountingRandom) -> tuple[list[list[T]], bool]:
        items = list(islice(pull, self._read_ahead))
        batches = self._cut(items)
        if self._shuffle:
            rng.shuffle(batches)
        return batches, len(items) < self._read_ahead

    def _cut(self, items: list[T]) -> list[list[T]]:
        """The window's batches, largest keys first."""
        key, boundary_key, batch_size = self._key, self._boundary_key, self._batch_size
        if key is not None:
            items.sort(key=key, reverse=True)
        fixed = batch_size if isinstance(batch_size, int) else None
        batches: list[list[T]] = []
        batch: list[T] = []
        capacity: Any = 0
        previous: Any = None
        for item in items:
            if boundary_key is not None:
                boundary = boundary_key(item)
                if boundary is None:
                    raise ValueError(
                        f"BucketedReadaheadBatchIterator: boundary_key returned None for {item!r}"
                    )
                if batch and boundary != previous:
                    batches.append(batch)
                    batch = []
                previous = boundary
            if not batch:
                capacity = fixed if fixed is not None else batch_size(item)  # type: ignore[operator]
            batch.append(item)
            if len(batch) >= capacity:
                batches.append(batch)
                batch = []
        if batch:
            batches.append(batch)
        return batches
