"""Flattening: one input item becomes many output items, optionally read ahead in threads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any, ClassVar

from .._core.checks import require_callable, require_checkpointable, require_int
from .._core.names import short_repr
from .._core.notes import NOTE_PREFIX, add_note, has_library_note
from .._core.probe import Gauges
from .._core.protocol import CheckpointableIterator, State, StateMismatchError
from .._core.schema import FieldSpec, Int
from .._core.stage import fast_iterator, skip_items, source_state
from ..background.readers import ChunkRead, ReadAhead
from ._failures import BadRecord, failure, tolerant
from .bad_records import BudgetedStage, OnError

Selector = Callable[[Any], Iterable[Any]]
CHUNK_REPR_LIMIT = 240
"""Errors show source items (chunk paths) up to this length, cut in the middle beyond."""
Collections = Iterator[tuple[State, Any, Callable[[], Iterator[Any]]]]
"""(source state before the item, the item, how to get its collection) per source item."""


def _select(selector: Selector | None, selector_name: str, item: Any) -> Iterator[Any]:
    """``iter(selector(item))`` (or ``iter(item)``); a str or bytes collection is refused,
    as it would be flattened into single characters."""
    if selector is None:
        return iter(item)
    collection = selector(item)
    if isinstance(collection, (str, bytes, bytearray)):
        kind = type(collection).__name__
        raise TypeError(
            f"{selector_name} returned a {kind} for {short_repr(item, CHUNK_REPR_LIMIT)}: it "
            f"must return an iterable of items (e.g. a list of lines); a {kind} would be "
            "flattened into single characters"
        )
    return iter(collection)


def _select_tolerant(
    selector: Selector | None, selector_name: str, longest_run: int, item: Any
) -> Iterator[Any]:
    """`_select`, with a `BadRecord` for each record whose reading raised (`tolerant`)."""
    return tolerant(_select(selector, selector_name, item), longest_run)


class SelectManyIterator(BudgetedStage[Any]):
    """Yields the items of ``collection_selector(item)`` (or of ``item`` itself) for each
    item of the source, in order: a flat-map.

    With ``read_ahead=n`` the next `n` collections are read in background threads (one
    thread each, named ``infinibatch_like.SelectManyIterator.reader``: see
    `infinibatch_like.background.readers`) while the consumer
    works through the current one, e.g. reading and decompressing the next chunk files.
    Each such collection is materialized as a list, so up to ``n + 1`` are held in memory;
    the selector must be thread-safe. The output and the states are the same as without
    read-ahead.

    Args:
        source_iterator: the source; it is reset.
        collection_selector: maps a source item to an iterable, e.g. a chunk file name to
            its lines. None iterates over each item.
        read_ahead: how many collections to read ahead in threads (>= 0; 0 reads each one
            when the consumer reaches it).
        selector_name: how errors name the selector (``chunked_dataset_iterator`` passes
            ``"chunked_dataset_iterator's read_chunk_fn"``).
        on_empty: called with the source item whenever its collection is empty (e.g. to
            refuse a corpus whose chunks are all empty); may raise.
        on_error: ``"raise"`` (default), ``"skip"`` (`DEFAULT_SKIP_POLICY`) or a
            `SkipPolicy`: a record whose reading raises an Exception is skipped and
            reading goes on with the next record if the collection's iterator goes on
            after an error (the library's readers do; a generator does not: its chunk
            ends there, the rest of it unread). A chunk whose selector raises, or whose
            first record fails with nothing after it, is skipped whole (a ``"chunk"``
            entry). Each costs one item of the budget; see `skipped`.

    Raises:
        Exception: whatever the selector, or iterating its collection, raises, when the
            consumer reaches that item of the collection (the items before it are
            yielded), with a note naming the source item (the chunk).
        TypeError: if the selector returns a str or bytes (whose characters would become
            the items); without a selector, str items are iterated, as in infinibatch.
        SkipBudgetExceeded: with a `SkipPolicy`, when more records fail than it allows;
            the state then points at the failing record (or chunk).

    Checkpoint:
        ``{"source", "consumed"}``: the source's state before the current item, and how
        many of its collection's items were yielded. A restore takes that item from the
        source again, calls the selector again (re-reading one chunk) and skips
        `consumed` items: with the collection's ``skip`` where it is a
        `SkippableIterator` (a Parquet row group is sliced at the row, its earlier rows
        never converted), else by taking and dropping them. Collections read ahead are
        not part of the state. After an error in reading a collection, the state points
        at the failing item of it: a restore re-reads the chunk and raises there again,
        skipping nothing. With a `SkipPolicy`,
        `consumed` counts the failed records too, and ``"skips"`` holds the budget window
        and the ledger (bounded by ``keep_last``): a restore skips the same records.
    """

    _not_elastic = "it reads this rank's chunks, not shards"
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "consumed": Int(0),
    }
    _user_callables = ("collection_selector",)

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        collection_selector: Selector | None = None,
        *,
        read_ahead: int = 0,
        selector_name: str = "SelectManyIterator's collection_selector",
        on_empty: Callable[[Any], None] | None = None,
        on_error: OnError = "raise",
    ) -> None:
        require_checkpointable("SelectManyIterator", "source_iterator", source_iterator)
        self._init_budget("SelectManyIterator", on_error)
        if collection_selector is not None:
            require_callable("SelectManyIterator", "collection_selector", collection_selector)
        if on_empty is not None:
            require_callable("SelectManyIterator", "on_empty", on_empty)
        self._read_ahead = require_int("SelectManyIterator", "read_ahead", read_ahead, 0)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._selector = collection_selector
        self._selector_name = str(selector_name)
        self._on_empty = on_empty
        self._window: ReadAhead | None = None
        self._restore(None)

    def _state(self) -> State:
        return {
            "source": self._anchor,
            "consumed": self._consumed,
            **self._skip_fields(self._base + self._consumed),
        }

    def _restore(self, state: State | None) -> None:
        if state is None:
            self.restore_source(self._source, None)
            self._anchor, self._consumed = source_state(self._source), 0
        else:
            self.restore_source(self._source, state["source"])
            self._anchor, self._consumed = state["source"], state["consumed"]
        self._restore_budget(state)
        self._base = self._seen - self._consumed  # the position of the collection's start
        self._window = None
        collections = self._read_now() if self._read_ahead == 0 else self._read_early()
        self._iterator = self._generate(collections, self._consumed)

    def _state_before_last(self) -> State | None:
        state = self.getstate()
        if state["consumed"] < 1:  # the last item came from an earlier collection
            return None
        state["consumed"] -= 1
        return state

    def _reader(self) -> Callable[[Any], Iterator[Any]]:
        """How to open an item's collection: `_select`, read `tolerant`ly with a budget."""
        if self._budget is None:
            return partial(_select, self._selector, self._selector_name)
        run = self._budget.policy.longest_run
        return partial(_select_tolerant, self._selector, self._selector_name, run)

    def _read_now(self) -> Collections:
        """(source state before the item, the item, how to get its collection) per item."""
        source, select = self._source, self._reader()
        pull = fast_iterator(source)
        while True:
            anchor = source_state(source)
            try:
                item = next(pull)
            except StopIteration:
                return
            yield anchor, item, partial(select, item)

    def _gauges(self) -> Gauges | None:
        """The read-ahead's gauges (None without read-ahead or before it started here)."""
        window = self._window
        return None if window is None else window.gauges()

    def _read_early(self) -> Collections:
        """As `_read_now`, with the next `read_ahead` collections read in threads."""
        source, select = self._source, self._reader()
        pull = fast_iterator(source)
        timed = self._probe is not None
        self._window = window = ReadAhead(self._read_ahead, self._probe)
        pending = window.pending
        skip = self._consumed  # of the first collection: the restored one
        exhausted = False
        failure: Exception | None = None  # the source's, raised where it happened
        try:
            while True:
                while not exhausted and len(pending) <= self._read_ahead:
                    anchor = source_state(source)
                    try:
                        item = next(pull)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as error:
                        exhausted, failure = True, error
                        break
                    read = ChunkRead(self._name, partial(select, item), skip, timed)
                    skip = 0
                    pending.append((anchor, item, read))
                if not pending:
                    window.advance(None)
                    if failure is not None:
                        raise failure
                    return
                anchor, item, read = pending.popleft()
                window.advance(read)
                yield anchor, item, read.result
        finally:
            window.close()

    def _generate(self, collections: Collections, skip: int) -> Iterator[Any]:
        """The items of the collections, each restored one from its item `skip` on. With a
        budget, a chunk that cannot be opened and the records whose reading raised (their
        `BadRecord`s) are skipped; `_consumed` counts those records as positions."""
        on_empty, skipping = self._on_empty, self._budget is not None
        for self._anchor, item, collection in collections:
            self._base += self._consumed - skip  # past the previous collection, if any
            self._consumed = skip
            try:
                try:
                    inner = self._open(collection)
                except Exception as error:
                    if not skipping or skip:  # it opened before the checkpoint: a real failure
                        raise
                    self._skip_bad(failure(error, "chunk"), self._base, item)
                    self._base += 1
                    continue
                if skip:
                    skip_items(inner, skip, self._name, "the current collection")
                if skipping:
                    for index, output in enumerate(inner, skip):
                        if type(output) is BadRecord:  # the state points at it until counted
                            self._skip_bad(output, self._base + index, item, index)
                            self._consumed = index + 1
                            continue
                        self._consumed = index + 1
                        yield output
                else:
                    for self._consumed, output in enumerate(inner, skip + 1):
                        yield output
            except Exception as error:
                self._note_reading_error(error, item)
                raise
            if not self._consumed and on_empty is not None:
                on_empty(item)
            skip = 0
        self._base += self._consumed - skip
        self._source_ended(skip)

    def _open(self, collection: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """The items of `collection` (a chunk's reader), its opening timed in full while
        statistics are on."""
        probe = self._probe
        return collection() if probe is None else probe.timed(collection)

    def _source_ended(self, skip: int) -> None:
        """Record the end of the source, refusing a checkpoint that was inside a
        collection (`skip` of its items consumed) when there is none left."""
        if skip:
            raise self.mismatch(
                f"the checkpoint is inside a collection ({skip} items consumed), "
                "but the source is exhausted"
            )
        self._anchor, self._consumed = source_state(self._source), 0

    def _note_reading_error(self, error: Exception, item: Any) -> None:
        """Name the item (the chunk) whose collection failed in a note on `error`."""
        if isinstance(error, StateMismatchError) or has_library_note(error):
            return
        reader = self._selector_name if self._selector is not None else "iterating"
        add_note(
            error,
            f"{NOTE_PREFIX}by {reader} on {short_repr(item, CHUNK_REPR_LIMIT)}, "
            f"after {self._consumed} of its items)",
        )
