"""Per-sample lineage: which chunk and which record each token range of a step came from.

Training runs the plain pipeline, at no cost per item: a `LineageLog` keeps the
pipeline's state every `every` steps (the states name positions the stages track
already: a few hundred bytes every `every` steps, well under 16 bytes per sample). The
origins of any step are computed on demand, by a traced twin of the pipeline (the same
stages and arguments, its chunks read with `traced_chunks`, transforms applied with
`on_value`, keys and costs with `of_value`, ``PackingIterator(..., traced=True)``): the
twin restores the snapshot before the step and replays the steps since, each record
travelling as an ``[origin, record]`` pair, and ``traced=True`` records for each piece
of a packed sequence the document's origin and the offset of the piece in it (16 bytes
per piece; `collate_packed` keeps them). The twin's states are the plain pipeline's.

Items held in a state (a `BufferedShuffleIterator`'s buffer) were read before the
snapshot: the twin takes them as of unknown origin (`UNKNOWN`), and `LineageLog.explain`
steps back to earlier snapshots until none of the step's samples is one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._core.checks import require_callable, require_int
from .._core.notes import pipeline_stages
from .._core.protocol import CheckpointableIterator, State

T = TypeVar("T")
R = TypeVar("R")

_RECORD_BITS = 32
UNKNOWN = -1
"""The origin of an item that was held in the state `explain` started from."""
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
        raise TypeError(
            f"{owner}: expected an [origin, value] pair (records read with traced_chunks), "
            f"got {_preview(pair)}"
        )
    return pair[0]


@dataclass(frozen=True)
class TokenOrigin:
    """Where a token range of a packed item came from.

    Attributes:
        sequence: the packed sequence's index in the item (0 for a single sequence).
        start: the range's first token in that sequence.
        end: one past its last token.
        chunk: the chunk's number (in the `traced_chunks` list); `UNKNOWN` for a record
            that was held in the state the replay started from.
        record: the record's number in the chunk (`UNKNOWN` likewise).
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
        if self.chunk == UNKNOWN:
            return (
                f"sequence {self.sequence} tokens [{self.start}, {self.end}): a record held "
                f"in the checkpoint, from token {self.offset}"
            )
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
            found.append(_located(row, start, end, origin, offset, chunk_refs))
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
            found.append(
                _located(index, bounds[piece], bounds[piece + 1], origin, offset, chunk_refs)
            )
    return found


def _located(
    sequence: int, start: int, end: int, origin: int, offset: int, refs: Sequence[Any] | None
) -> TokenOrigin:
    if origin == UNKNOWN:
        return TokenOrigin(sequence, start, end, UNKNOWN, UNKNOWN, offset)
    chunk, record = origin_parts(origin)
    return TokenOrigin(
        sequence, start, end, chunk, record, offset, None if refs is None else refs[chunk]
    )


def explain(
    pipeline: CheckpointableIterator[Any],
    checkpoint: State | None,
    steps: int,
    chunk_refs: Sequence[Any] | None = None,
) -> list[TokenOrigin]:
    """The origins of the item that `pipeline` yields `steps` items after `checkpoint`.

    `pipeline` is the traced twin of the pipeline `checkpoint` comes from (with lineage
    on); it is restored from `checkpoint` (None: the start), `steps` items are skipped and
    the next one is explained with `origins_of`: e.g. the checkpoint saved at step 10,000
    and ``steps=37`` explain step 10,037, running 38 steps, not 10,038. The items that
    `checkpoint` holds (a `BufferedShuffleIterator`'s buffer) enter the twin as of
    `UNKNOWN` origin: the ranges they give are named so (`LineageLog.explain` starts
    from an earlier snapshot then).
    """
    require_int("explain", "steps", steps, 0)
    if checkpoint is not None:
        checkpoint = _held_as_unknown(pipeline, checkpoint)
    pipeline.setstate(checkpoint)
    for _ in range(steps):
        next(pipeline)
    return origins_of(next(pipeline), chunk_refs)


def _held_as_unknown(pipeline: CheckpointableIterator[Any], state: State) -> State:
    """`state` with the items its stages hold made ``[UNKNOWN, item]`` pairs, by the
    stages of `pipeline` that hold items (their ``_held_items_as``)."""
    converters: dict[str, Callable[[State, Callable[[Any], Any]], State]] = {}
    for stage in pipeline_stages(pipeline):
        convert = getattr(type(stage), "_held_items_as", None)
        if convert is not None:
            converters[type(stage).__name__] = convert

    def converted(value: Any) -> Any:
        if type(value) is dict:
            convert = converters.get(value.get("stage"))  # type: ignore[arg-type]
            if convert is not None:
                return convert(value, _unknown_pair)
            return {key: converted(part) for key, part in value.items()}
        if type(value) is list:
            return [converted(part) for part in value]
        return value

    return converted(state) if converters else state


def _unknown_pair(item: Any) -> Traced:
    return [UNKNOWN, item]


class LineageLog:
    """The training side of lineage: the pipeline's state every `every` steps, kept so
    that `explain` can name the origins of any step from the snapshot before it.

    Call `after_step` once per item the pipeline yields (with the item's step number
    from 0); the snapshot of step n is the state before step n's item. ``snapshots`` is
    plain data (``[[step, state], ...]``, oldest first): save it with the checkpoints
    (JSON or `torch.save`) and give it back to a new log with `from_snapshots`.

    Cost: one ``getstate()`` of the pipeline every `every` steps, nothing per item; a
    snapshot is the pipeline's checkpoint (a few hundred bytes for block-wise shuffling,
    bucketing, mixing and packing), so the log costs the state's size / (`every` x
    samples per step) bytes per sample. States that hold items (a
    `BufferedShuffleIterator`'s buffer) are as large as their items.
    """

    def __init__(self, every: int = 1000) -> None:
        self.every = require_int("LineageLog", "every", every, 1)
        self.snapshots: list[list[Any]] = []

    @classmethod
    def from_snapshots(cls, snapshots: Sequence[Any], every: int = 1000) -> LineageLog:
        """A log holding `snapshots` (a saved ``snapshots`` list), to explain from."""
        log = cls(every)
        for entry in snapshots:
            if not (type(entry) in (list, tuple) and len(entry) == 2 and type(entry[0]) is int):
                raise ValueError(
                    f"LineageLog.from_snapshots: expected [step, state] pairs, got "
                    f"{_preview(entry)}"
                )
            log.snapshots.append([entry[0], entry[1]])
        log.snapshots.sort(key=lambda entry: entry[0])
        return log

    def after_step(self, step: int, pipeline: CheckpointableIterator[Any]) -> None:
        """Record the state before step ``step + 1`` if it is a multiple of `every` (step
        -1, before the first item, records the start)."""
        following = step + 1
        if following % self.every == 0:
            self.snapshots.append([following, pipeline.getstate()])

    def explain(
        self,
        twin: CheckpointableIterator[Any],
        step: int,
        chunk_refs: Sequence[Any] | None = None,
    ) -> list[TokenOrigin]:
        """The origins of step `step`'s item, replayed by `twin` (the pipeline's traced
        twin) from the latest snapshot at or before it; while some of its samples were
        held in the snapshot's state, from an earlier one (1, 2, 4, ... snapshots further
        back, then the start of the run).

        Raises:
            ValueError: if `step` is negative.
        """
        require_int("LineageLog.explain", "step", step, 0)
        starts: list[tuple[int, State | None]] = [(0, None)]
        starts.extend((at, state) for at, state in self.snapshots if at <= step)
        back, index = 1, len(starts) - 1
        while True:
            at, state = starts[index]
            found = explain(twin, state, step - at, chunk_refs)
            if index == 0 or all(origin.chunk != UNKNOWN for origin in found):
                return found
            index, back = max(0, index - back), 2 * back


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
