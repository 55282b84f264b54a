"""Batched transforms: a function applied to lists of items at once (a tokenizer's
``encode_batch``, a numpy function), with a checkpoint between any two items."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import ClassVar, TypeVar

from .._core.checks import batch_outputs, require_callable, require_checkpointable, require_int
from .._core.protocol import CheckpointableIterator, State
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage, fast_iterator, source_state

T = TypeVar("T")
U = TypeVar("U")


class BatchMapIterator(Stage[U]):
    """Yields ``transform_batch(batch)[i]`` for each item of the source, where `batch`
    is the list of the `batch_size` source items that the item belongs to: the output is
    that of ``MapIterator(source, f)`` for a per-item ``f`` that `transform_batch`
    applies to each item of a list. The last batch may be shorter.

    For transforms that cost less per item when called on many items at once: a
    tokenizer's ``encode_batch`` (which also runs its batch on several cores), a numpy
    function over a stacked array. To run it in worker processes or threads, use
    ``ParallelMapIterator(..., batched=True)``.

    Args:
        source_iterator: the source.
        transform_batch: called with a list of items; returns a sequence (a list, an
            array: iterated) of exactly one output per item, in order.
        batch_size: items per call (>= 1).

    Raises:
        ValueError: in the constructor for a bad `batch_size`; when iterating, if
            `transform_batch` returns another number of outputs than it was given
            items (naming this stage).
        Exception: whatever `transform_batch` raises, with a note naming this stage;
            ``getstate()`` then points at the start of that batch.

    Checkpoint:
        ``{"source", "offset"}``: the source's state at the start of the current batch
        and the number of its outputs already yielded (< `batch_size`; once a batch is
        used up, the state points at the start of the next one). Size: one source state
        plus an int. A restore with an offset reads that batch again and calls
        `transform_batch` on it (at most `batch_size` - 1 re-read items), then skips
        `offset` outputs.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "offset": Int(0, below=lambda stage: stage._batch_size, name="batch_size"),
    }
    _user_callables = ("transform_batch",)

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        transform_batch: Callable[[list[T]], Sequence[U]],
        batch_size: int,
    ) -> None:
        owner = "BatchMapIterator"
        require_checkpointable(owner, "source_iterator", source_iterator)
        require_callable(owner, "transform_batch", transform_batch)
        require_int(owner, "batch_size", batch_size, 1)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._transform = transform_batch
        self._batch_size = batch_size
        self._restore(None)

    def _arguments(self) -> State:
        return {"batch_size": self._batch_size}

    def _generate(self, skip: int) -> Iterator[U]:
        pull, size, transform = fast_iterator(self._source), self._batch_size, self._transform
        while True:
            items = list(islice(pull, size))
            if not items:
                return
            outputs = batch_outputs(self._name, transform, items)
            last = len(outputs) - 1
            for index in range(skip, len(outputs)):
                if index == last:  # the batch is used up: a restore starts at the next one
                    self._start, self._offset = source_state(self._source), 0
                else:
                    self._offset = index + 1
                yield outputs[index]
            skip = 0

    def _state(self) -> State:
        return {"source": self._start, "offset": self._offset}

    def _restore(self, state: State | None) -> None:
        skip = 0
        if state is not None:
            skip = state["offset"]
        self.restore_source(self._source, None if state is None else state["source"])
        self._start, self._offset = source_state(self._source), skip
        self._iterator = self._generate(skip)
