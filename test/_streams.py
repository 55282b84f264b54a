"""Sources, chunk readers and drains that many tests build pipelines from and read them with.

Everything here is module level (or an instance of a module-level class), so that pipelines
built from it pickle into worker processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Generic, TypeVar

import infinibatch_like.iterators as it

T = TypeVar("T")


def native(items: int | Iterable[T]) -> it.NativeCheckpointableIterator[Any]:
    """A source of ``0 .. items - 1`` (an int), or of the given items."""
    return it.NativeCheckpointableIterator(
        list(range(items)) if isinstance(items, int) else list(items)
    )


def take(iterator: Iterator[T], count: int) -> list[T]:
    """The next `count` items of `iterator` (fewer where it ends first)."""
    return list(islice(iterator, count))


def drain(pipeline: Iterable[T], sink: list[T], until: int | None = None) -> None:
    """Append the items of `pipeline` to `sink` (which keeps them when an error stops it):
    all of them, or until `sink` holds `until` items."""
    for item in pipeline if until is None else islice(pipeline, until - len(sink)):
        sink.append(item)


def roundtrip(state: Any) -> Any:
    """`state` through JSON, as a checkpoint file gives it back."""
    return json.loads(json.dumps(state))


@dataclass(frozen=True)
class ChunkReader(Generic[T]):
    """A ``read_chunk_fn`` over an in-memory corpus: the chunk a reference names."""

    chunks: Sequence[list[T]] | Mapping[Any, list[T]]

    def __call__(self, ref: Any) -> list[T]:
        return self.chunks[ref]


def split_by_checkpoint(
    make: Callable[[], it.CheckpointableIterator[T]], count: int
) -> tuple[list[T], list[T]]:
    """The first `count` items of a pipeline that `make` builds, and all that a fresh one
    restored from the state taken after them yields (both pipelines closed)."""
    with make() as pipeline:
        head = take(pipeline, count)
        state = pipeline.getstate()
    with make() as fresh:
        fresh.setstate(state)
        return head, list(fresh)
