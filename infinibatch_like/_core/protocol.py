"""The checkpointable-iterator protocol: what every iterator of a pipeline offers, and the
error a state that does not fit raises."""

from __future__ import annotations

import collections.abc
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T_co = TypeVar("T_co", covariant=True)
SelfIterator = TypeVar("SelfIterator", bound="CheckpointableIterator[Any]")

State = dict[str, Any]
"""A checkpoint: plain data (dicts with str keys, lists, str, int, float, bool, None)."""


class CheckpointableIterator(collections.abc.Iterator[T_co]):
    """An iterator whose position can be saved with `getstate` and restored with `setstate`.

    This is the protocol of infinibatch 0.1.1: subclasses implement ``__next__``,
    ``getstate``, ``setstate`` and ``close``. ``getstate`` covers the whole upstream chain,
    ``setstate(None)`` resets the chain to its state right after construction, and
    ``close`` releases background resources. Iterators are also context managers:
    ``with pipeline as it:`` closes the pipeline on exit.

    Checkpoint:
        Defined by each implementation; see the stage's own documentation.
    """

    def __iter__(self) -> CheckpointableIterator[T_co]:
        return self

    @abstractmethod
    def __next__(self) -> T_co: ...

    @abstractmethod
    def getstate(self) -> State:
        """Return the iterator's position as plain data, without advancing it."""

    @abstractmethod
    def setstate(self, checkpoint: State | None) -> None:
        """Continue from `checkpoint` (a `getstate` result), or from the start if None."""

    @abstractmethod
    def close(self) -> None:
        """Release background resources; idempotent."""

    def __enter__(self: SelfIterator) -> SelfIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


GATHERED_FORMAT = "infinibatch_like.gather_state/1"
"""The ``"format"`` of the dicts made by `infinibatch_like.distributed.ranks.gather_state`."""


class StateMismatchError(ValueError):
    """A checkpoint does not fit the pipeline it is given to.

    The message names the path of stages from the outermost one down to the stage that
    rejected the state, e.g. ``MapIterator.source > SelectManyIterator``.
    """

    def __init__(self, reason: str, path: Sequence[str] = ()) -> None:
        self.reason = reason
        self.path = tuple(path)
        super().__init__(reason, self.path)

    def within(self, where: str) -> StateMismatchError:
        """The same error seen from one stage further downstream."""
        return StateMismatchError(self.reason, (where, *self.path))

    def __str__(self) -> str:
        if not self.path:  # rebuilt from its message, as torch re-raises a worker's error
            return self.reason
        return f"checkpoint does not fit this pipeline at {' > '.join(self.path)}: {self.reason}"


class SkippableIterator(Iterator[T_co]):
    """An iterator that can pass over items without producing them: a chunk reader whose
    ``skip(count)`` is cheaper than ``count`` calls of ``next()`` (e.g. a Parquet row group
    sliced at a row, rather than every earlier row decoded into a dict).

    A stage that restores inside a collection (`SelectManyIterator`, hence
    `chunked_dataset_iterator`) calls ``skip`` on a collection that is one, instead of
    taking and dropping the items before the checkpoint.
    """

    @abstractmethod
    def skip(self, count: int) -> int:
        """Pass over the next `count` items, exactly as `count` calls of ``next()`` would
        (a call that raises counts as one item); return how many there were (fewer than
        `count` only where the iterator ends)."""
