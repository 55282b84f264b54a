"""One-to-one transforms of items."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from random import Random
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_callable, require_checkpointable
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
from .._core.stage import Stage, fast_iterator, source_state, state_before_last
from ._failures import failure
from .bad_records import BudgetedStage, OnError

T = TypeVar("T")
U = TypeVar("U")


class MapIterator(BudgetedStage[U]):
    """Yields ``transform(item)`` for each item of the source.

    The source is not reset (as in infinibatch). Chains of MapIterators run as nested
    builtin ``map`` objects: a stage adds only the cost of calling its transform.

    Args:
        source_iterator: the source.
        transform: the function to apply.
        on_error: ``"raise"`` (default), ``"skip"`` (`DEFAULT_SKIP_POLICY`) or a
            `SkipPolicy`: an item whose transform raises an Exception is skipped and
            entered in the ledger (`skipped`), within the policy's budget. This runs the
            map as a Python generator (a little slower per item than the builtin ``map``
            of ``"raise"``).

    Raises:
        Exception: whatever `transform` raises, with a note naming this stage, the
            transform and the item.
        SkipBudgetExceeded: with a `SkipPolicy`, when more items fail than it allows.

    Checkpoint:
        ``{"source"}``: the source's state; nothing is re-read on restore. After an error
        in `transform`, the state is the source's state one item back, so that a restore
        calls the transform on the failing item again (nothing skipped). Sources that can
        step back one item: lists (`NativeCheckpointableIterator`), `SelectManyIterator`,
        the block-wise shuffle and bucketed batches, and MapIterators over them; over any
        other source `getstate` raises RuntimeError after such an error (restore a
        checkpoint taken before it): keeping each input would cost every item a copy.
        With a `SkipPolicy`, also ``"skips"``: the budget window and the ledger (see
        `infinibatch_like.stages.bad_records.Budget`; bounded by ``keep_last``); a restore skips
        the same items again. When the budget is exceeded, the state steps back to the
        failing item as after an error.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {"source": dict}
    _user_callables = ("transform",)
    _loses_input_on_error = True
    _source_field = "source"
    _not_elastic = None  # its state is its source's: elastic over a ShardedIterator

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        transform: Callable[[T], U],
        *,
        on_error: OnError = "raise",
    ) -> None:
        require_checkpointable("MapIterator", "source_iterator", source_iterator)
        require_callable("MapIterator", "transform", transform)
        self._init_budget("MapIterator", on_error)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._transform = transform
        self._iterator = self._mapped()

    def _mapped(self) -> Iterator[U]:
        pull = fast_iterator(self._source)
        if self._budget is None:
            return map(self._transform, pull)
        return self._skipping(pull)

    def _skipping(self, pull: Iterator[Any]) -> Iterator[U]:
        """The transform's outputs, with the items whose transform raised skipped (the
        transform is called here rather than through `Guarded`: a frame less per item)."""
        transform = self._transform
        for item in pull:
            try:
                output = transform(item)
            except Exception as error:
                self._skip_bad(failure(error), self._seen)
                self._seen += 1
                continue
            self._seen += 1
            yield output

    def _state(self) -> State:
        return {"source": source_state(self._source), **self._skip_fields(self._seen)}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._restore_budget(state)
        self._iterator = self._mapped()

    def _fields_after_lost_input(self) -> State:
        before = state_before_last(self._source)  # one in, one out
        if before is None:
            return super()._fields_after_lost_input()
        return {"source": before, **self._skip_fields(self._seen)}

    def _state_before_last(self) -> State | None:
        before = state_before_last(self._source)  # one in, one out
        if before is None:
            return None
        return {"stage": self._name, "source": before, **self._skip_fields(self._seen - 1)}


class SamplingRandomMapIterator(Stage[U]):
    """Yields ``transform(rng, item)`` for each item, with one checkpointed ``Random(seed)``.

    `rng` is a ``random.Random`` drawing exactly the numbers of ``random.Random(seed)``;
    the transform may call any of its methods except ``seed``/``setstate``.

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "gauss_next"}``: the source's state and
        the generator's position (see `infinibatch_like._core.rng`). Constant size; a restore
        redraws at most 2**24 words at C speed. As with `MapIterator`, `getstate` raises
        RuntimeError after an error in `transform` (its item is consumed, and the failed
        call may have drawn from the generator): restore an earlier checkpoint.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "seed": (int, str),
        **MARK_FIELDS,
        "gauss_next": (float, type(None)),
    }
    _user_callables = ("transform",)
    _loses_input_on_error = True

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        transform: Callable[[Random, T], U],
        seed: Seed | None = 0,
    ) -> None:
        require_checkpointable("SamplingRandomMapIterator", "source_iterator", source_iterator)
        require_callable("SamplingRandomMapIterator", "transform", transform)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._transform = transform
        self._seed, self._seed_drawn = resolve_seed("SamplingRandomMapIterator", seed)
        self._restore(None)

    def _state(self) -> State:
        rng = self._rng
        return {
            "source": source_state(self._source),
            "seed": self._seed,
            **mark_fields(rng.mark()),
            "gauss_next": rng.gauss_next,
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        if state is None:
            self._rng = CountingRandom(self._seed)
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            mark = read_mark(self, state["draws"], state["generator"])
            self._rng = CountingRandom.from_mark(self._seed, mark, state["gauss_next"])
        self._iterator = map(partial(self._transform, self._rng), fast_iterator(self._source))
