"""Per-sample lineage: which chunk and which record each token range of a step came from.

A pipeline is traced when its chunks are read with `traced_chunks`: every record then
travels as an ``[origin, record]`` pair (plain data: it goes through shuffling, mixing,
bucketing, background workers and checkpoints like any item), transforms apply to the
record with `on_value` (keys and costs with `of_value`), and ``PackingIterator(...,
traced=True)`` records, for each piece of a packed sequence, the document's origin and
the offset of the piece in it: 16 bytes per piece (`collate_packed` keeps them).

Two ways to use it:

- On demand, at no cost in training: train with the plain pipeline, and build its traced
  twin (the same stages and arguments, traced as above) only to ask. `explain` restores
  the plain run's checkpoint into the twin (their states are the same) and replays the
  steps since it. This needs states that hold no items, as those of
  `chunked_dataset_iterator`, block-wise shuffling, bucketing, mixing and packing (a
  `BufferedShuffleIterator`'s buffer holds plain items, on which the twin's `on_value`
  and `of_value` raise TypeError).
- Carried: train with the traced pipeline, to log every batch's origins; each item then
  costs a pair and a call more (1.95x the CPU time on P1, whose per-line work is a
  ``str.split``: ``bench/bench_lineage.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._core.checks import require_callable, require_int
from .._core.protocol import CheckpointableIterator, State

T = TypeVar("T")
R = TypeVar("R")

_RECORD_BITS = 32
Traced = list[Any]
"""An ``[origin, value]`` pair: `origin_id` of the record it comes from, and the value."""


def origin_id(chunk: int, record: int) -> int:
    """One int naming record `record` (from 0) of chunk number `chunk` (from 0)."""
    require_int("origin_id", "chunk", chunk, 0)
    require_int("origin_id", "record", record, 0)
    if record >= 1 << _RECORD_BITS or chunk >= 1 << (63 - _RECORD_BITS):
        raise ValueError(f"origin_id: chunk {chunk} or record {record} is too large")
    return chunk << _RECORD_BITS | record


def origin_parts(origin: int) -> tuple[int, int]:
    """``(chunk, record)`` of an `origin_id`."""
    return origin >> _RECORD_BITS, origin & ((1 << _RECORD_BITS) - 1)


class traced_chunks(Generic[T]):
    """A chunk reader for `chunked_dataset_iterator` whose records come as ``[origin,
    record]`` pairs, the origin naming the chunk's number in `chunk_refs` and the
    record's number in the chunk (picklable if `read_chunk` is).

    Raises:
        ValueError: when asked for a chunk that is not in `chunk_refs`, naming it.
    """

    def __init__(self, read_chunk: Callable[[Any], Iterable[T]], chunk_refs: Sequence[Any]):
        require_callable("traced_chunks", "read_chunk", read_chunk)
        self.read_chunk = read_chunk
        self.chunk_refs = list(chunk_refs)
        self._numbers = {ref: number for number, ref in enumerate(self.chunk_refs)}

    def __call__(self, chunk_ref: Any) -> list[Traced]:
        number = self._numbers.get(chunk_ref)
        if number is None:
            raise ValueError(f"traced_chunks: the chunk {chunk_ref!r} is not in chunk_refs")
        base = number << _RECORD_BITS
        return [[base | index, record] for index, record in enumerate(self.read_chunk(chunk_ref))]


class on_value(Generic[T, R]):
    """``function`` applied to the value of an ``[origin, value]`` pair; the origin is
    kept: ``MapIterator(records, on_value(tokenize))``."""

    def __init__(self, function: Callable[[T], R]) -> None:
        require_callable("on_value", "function", function)
        self.function = function

    def __call__(self, pair: Traced) -> Traced:
        return [_origin(pair, "on_value"), self.function(pair[1])]


class of_value(Generic[T, R]):
    """``function`` of the value of an ``[origin, value]`` pair, for costs and keys:
    ``TokenBudgetMultiplexIterator(sources, weights, cost=of_value(len))``."""

    def __init__(self, function: Callable[[T], R]) -> None:
        require_callable("of_value", "function", function)
        self.function = function

    def __call__(self, pair: Traced) -> R:
        _origin(pair, "of_value")
        return self.function(pair[1])


def _origin(pair: Any, owner: str) -> int:
    """The origin of an ``[origin, value]`` pair; TypeError if `pair` is not one."""
    if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not int:
        text = repr(pair)
        raise TypeError(
            f"{owner}: expected an [origin, value] pair (records read with traced_chunks), "
            f"got {text if len(text) <= 80 else text[:77] + '...'}"
        )
    return pair[0]


@dataclass(frozen=True)
class TokenOrigin:
    """Where a token range of a packed item came from.

    Attributes:
        sequence: the packed sequence's index in the item (0 for a single sequence).
        start: the range's first token in that sequence.
        end: one past its last token.
        chunk: the chunk's number (in the `traced_chunks` list).
        record: the record's number in the chunk.
        offset: the range's first token within the record's document (after tokenization).
        chunk_ref: the chunk's reference, when `explain` was given the chunk list.
    """

    sequence: int
    start: int
    end: int
    chunk: int
    record: int
    offset: int
    chunk_ref: Any = None

    def __str__(self) -> str:
        where = self.chunk_ref if self.chunk_ref is not None else f"chunk {self.chunk}"
        return (
            f"sequence {self.sequence} tokens [{self.start}, {self.end}): {where}, record "
            f"{self.record}, from token {self.offset}"
        )


def origins_of(item: Any, chunk_refs: Sequence[Any] | None = None) -> list[TokenOrigin]:
    """The origins of every token range of `item`: a traced `PackedSequence`, a list of
    them (a batch), or the `PackedBatch` that `collate_packed` makes of them.

    Raises:
        ValueError: if `item` holds no ``origins`` (a pipeline without ``traced=True``).
    """
    batch_origins = getattr(item, "origins", None)
    if batch_origins is not None and hasattr(item, "cu_seqlens"):  # a collated PackedBatch
        found = []
        for row, start, end, origin, offset in batch_origins.tolist():
            chunk, record = origin_parts(origin)
            ref = None if chunk_refs is None else chunk_refs[chunk]
            found.append(TokenOrigin(row, start, end, chunk, record, offset, ref))
        return found
    sequences = item if isinstance(item, (list, tuple)) else [item]
    found = []
    for index, sequence in enumerate(sequences):
        if not isinstance(sequence, dict) or "origins" not in sequence:
            raise ValueError(
                f"origins_of: item {index} holds no 'origins': build the PackingIterator "
                "with traced=True over records read with traced_chunks"
            )
        bounds = sequence["cu_seqlens"].tolist()
        for piece, (origin, offset) in enumerate(sequence["origins"].tolist()):
            chunk, record = origin_parts(origin)
            ref = None if chunk_refs is None else chunk_refs[chunk]
            found.append(
                TokenOrigin(index, bounds[piece], bounds[piece + 1], chunk, record, offset, ref)
            )
    return found


def explain(
    pipeline: CheckpointableIterator[Any],
    checkpoint: State | None,
    steps: int,
    chunk_refs: Sequence[Any] | None = None,
) -> list[TokenOrigin]:
    """The origins of the item that `pipeline` yields `steps` items after `checkpoint`.

    `pipeline` is built as the training's (with lineage on); it is restored from
    `checkpoint` (None: the start), `steps` items are skipped and the next one is
    explained with `origins_of`: e.g. the checkpoint saved at step 10,000 and ``steps=
    37`` explain step 10,037, running 38 steps, not 10,038.
    """
    require_int("explain", "steps", steps, 0)
    pipeline.setstate(checkpoint)
    for _ in range(steps):
        next(pipeline)
    return origins_of(next(pipeline), chunk_refs)
