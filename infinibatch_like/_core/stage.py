"""`Stage`: the machinery every stage of the library shares.

A pipeline is a chain of stages. Each stage keeps its items flowing through a plain
Python iterator (``_iterator``: a builtin ``map``/``zip``, a list iterator or a
generator). A downstream stage pulls from its source's ``_iterator`` directly, so the
per-item path of a chain crosses no Python-level ``__next__`` except the outermost one.
States are computed on demand from what each stage tracks, never pickled.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

from .arguments import StreamArguments
from .graph import Node, consumers_of, step_to
from .notes import note_error
from .pickling import Rebuildable
from .protocol import (
    GATHERED_FORMAT,
    CheckpointableIterator,
    SkippableIterator,
    State,
    StateMismatchError,
)
from .regroup import NOT_ELASTIC, Regroup
from .schema import FieldSpec, SchemaError, check_fields

if TYPE_CHECKING:
    from .probe import StageProbe

T = TypeVar("T")


def copy_plain(value: Any) -> Any:
    """A copy of `value`'s dicts and lists (the containers of a state); leaves are shared."""
    if type(value) is dict:
        return {key: copy_plain(item) for key, item in value.items()}
    if type(value) is list:
        return [copy_plain(item) for item in value]
    return value


def source_state(source: CheckpointableIterator[Any]) -> State:
    """`source`'s state, for a downstream stage to record or to return within its own.

    A stage's state is not copied here: ``getstate`` copies the whole state once, at the
    stage it is called on, so recording a source's position costs no copy.
    """
    if isinstance(source, Stage):
        return source._snapshot()
    return source.getstate()


def fast_iterator(source: Iterator[T]) -> Iterator[T]:
    """The iterator a downstream stage should pull from to read `source`'s items."""
    if isinstance(source, Stage):
        inner: Iterator[T] = source._iterator
        return inner
    return source


class _Halted(Iterator[Any]):
    """Stands in for a stage's item iterator once it is closed or has failed."""

    def __init__(self, message: str, cause: BaseException | None) -> None:
        self._message = message
        self._cause = cause

    def __next__(self) -> NoReturn:
        raise RuntimeError(self._message) from self._cause


class Stage(Node, StreamArguments, Rebuildable[T]):
    """Base class of this library's stages: states, restores, failure and close.

    A subclass sets ``_sources`` (its upstream iterators), ``_state_fields`` (the fields of
    its state besides ``"stage"``, each with the type or validator its value must fit: see
    `infinibatch_like._core.schema`, which checks a state in one pass) and implements
    ``_state()`` and ``_restore(state | None)``. ``_restore`` puts the upstream chain into
    place (through `restore_source`) and rebuilds ``_iterator``. A stage records its
    sources' positions with `source_state` (no copy) and, if some of its arguments decide
    the stream, returns them from ``_arguments()``. A stage built with user callables names
    their parameters in ``_user_callables``, so that an error they raise gets a note naming
    the stage (see `notes`); if such an error consumes the item the callable was given
    (a builtin ``map``), ``_loses_input_on_error`` makes the state step the source back to
    that item, or `getstate` refuse the undefined position until the next `setstate`.
    A base class that needs setting up offers ``_init_<base>(...)``, which sets fields
    only; a stage calls those of its bases in its ``__init__``, then ``self._restore(None)``
    last, as every stage does. A function that builds stages from its own arguments
    (``chunked_dataset_iterator``'s `buffer_size` becomes a shuffle's `block_size`) names
    them with `label_arguments`, so that a refused state names the argument the user passed.

    Features ask stages for capabilities that the stage classes declare, never for
    class names or private fields: ``_state_fields`` (validated by `_core.schema`),
    ``_source_field`` (where a wrapper's state holds its source's), ``_not_elastic`` and
    ``_regrouped`` (restores on another number of ranks), ``_replica_sources``
    (statistics add up copies of one pipeline).

    The base class gives every stage the contract's guarantees: states in and out are
    snapshots (`getstate` copies the state once, at the stage it is called on, and
    `setstate` copies what it is given); keys added to a state by the caller are ignored
    at every level; a state taken with other stream-deciding arguments is refused; after
    `close`, `getstate` still returns the position at the close.

    Restore the outermost stage (the one you iterate): it restores its sources. Calling
    `setstate` directly on a stage that another stage consumes would leave that consumer
    with its own position and buffers from before, reading a stream that no longer
    matches them (infinibatch silently carries on so). Here the consumers, up to the
    outermost stage, are marked at that call, at no per-item cost: their ``next()`` and
    ``getstate()`` raise a RuntimeError naming both stages until the outermost stage is
    restored (or reset with ``setstate(None)``).

    Checkpoint:
        ``{"stage": <class name>, **fields}``, plus ``"fingerprint"``: the stage's
        stream-deciding arguments, for stages that have some (a state without one, as
        written by version 0.1.0, is accepted unchecked).
    """

    _state_fields: ClassVar[Mapping[str, FieldSpec]] = {}
    _iterator: Iterator[T]
    _closed: bool = False
    _closed_state: State | None = None
    _closed_reason: str = ""
    _desync: str | None = None
    _probe: StageProbe | None = None
    """Statistics' counters while they are on (`infinibatch_like.stats`), else None."""
    _user_callables: ClassVar[tuple[str, ...]] = ()
    """Constructor parameters that take user callables (named in error notes)."""
    _loses_input_on_error: ClassVar[bool] = False
    """Whether an error in a user callable consumes the item it was called on."""
    _lost_input: str | None = None
    """Why the position is undefined after such an error (None: it is defined)."""
    _source_field: ClassVar[str | None] = None
    """For a stage whose state holds its one source's state in a field: that field
    (``"source"``). Features find the states within a state through it."""
    _not_elastic: ClassVar[str | None] = NOT_ELASTIC
    """Why this stage cannot sit above the `ShardedIterator` of a pipeline restored on
    another number of ranks (the refusal shows it), or None if it can: with a
    `_source_field`, its own fields are then the same on every rank (or adjusted by
    `_regrouped`)."""

    # -- iteration ---------------------------------------------------------------------

    def __next__(self) -> T:
        try:
            return next(self._iterator)
        except StopIteration:
            raise
        except BaseException as error:
            if not self._closed and not isinstance(self._iterator, _Halted):
                if isinstance(error, Exception):
                    note_error(self, error)
                self._iterator = _Halted(
                    f"{self._name} stopped after an error ({type(error).__name__}: {error}); "
                    "call setstate() with a checkpoint to continue",
                    error,
                )
            raise

    # -- after an error in a user callable (see `notes`) ---------------------------------

    def _fields_after_lost_input(self) -> State:
        """The state's fields after a user callable of this stage raised on an item taken
        from the source: by default none (RuntimeError saying why); a stage whose source
        can step back one item (`state_before_last`) returns the fields that re-attempt it."""
        raise RuntimeError(self._lost_input)

    def _state_before_last(self) -> State | None:
        """The state that yields this stage's last yielded item again, or None if the
        stage cannot tell. Asked only after an error lost that item downstream."""
        return None

    # -- checkpoints -------------------------------------------------------------------

    def getstate(self) -> State:
        state: State = copy_plain(self._snapshot())
        return state

    def _snapshot(self) -> State:
        """The state, not copied: what `source_state` gives to downstream stages."""
        if self._closed:
            if self._closed_state is None:
                raise RuntimeError(
                    f"{self._name}.getstate: the iterator is closed and its position could "
                    f"not be recorded at the close ({self._closed_reason})"
                )
            return self._closed_state
        if self._desync is not None:
            raise RuntimeError(self._desync)
        fields = self._state() if self._lost_input is None else self._fields_after_lost_input()
        state = {"stage": self._name, **fields}
        fingerprint = self._fingerprint
        if fingerprint:
            state["fingerprint"] = fingerprint
        return state

    def setstate(self, checkpoint: State | None) -> None:
        self._set(None if checkpoint is None else copy_plain(checkpoint), direct=True)

    def _set(self, checkpoint: State | None, direct: bool = False) -> None:
        """`setstate` without copying `checkpoint` (this stage may keep parts of it); then
        the restore observers are told (`direct`: called on this stage by the user rather
        than by a consumer restoring its sources), even if the restore failed part way."""
        if self._closed:
            raise RuntimeError(f"{self._name}.setstate: the iterator is closed")
        self._lost_input = self._desync = None
        try:
            self._restore(None if checkpoint is None else self._checked(checkpoint))
        finally:
            for observer in _RESTORE_OBSERVERS:
                observer(self, direct)

    def _checked(self, checkpoint: object) -> State:
        """`checkpoint` checked against this stage, with keys the caller added removed.

        The checkpoint is this pipeline's own copy (see `setstate`), so it is trimmed in
        place: stages that keep part of it see the same trimmed dicts.
        """
        if not isinstance(checkpoint, dict):
            raise self.mismatch(f"expected a dict, got {type(checkpoint).__name__}")
        stage = checkpoint.get("stage")
        if stage is None and checkpoint.get("format") == GATHERED_FORMAT:
            raise self.mismatch(
                "this is every rank's state gathered by gather_state(); restore it with "
                "infinibatch_like.distributed.restore_state(pipeline, state), which gives "
                "each rank its own"
            )
        if stage != self._name:
            raise self.mismatch(f"expected a state of {self._name}, got one of {stage!r}")
        fields = self._state_schema()
        known = {"stage", *fields}
        fingerprint = self._fingerprint
        if fingerprint and "fingerprint" in checkpoint:  # states of 0.1.0 have none
            # first: other arguments explain fields that do not fit (one per consumer)
            self._check_fingerprint(checkpoint["fingerprint"], fingerprint)
            checkpoint["fingerprint"] = fingerprint
            known.add("fingerprint")
        try:
            check_fields(fields, checkpoint, self)
        except SchemaError as error:
            raise self.mismatch(str(error)) from None
        for extra in [key for key in checkpoint if key not in known]:
            del checkpoint[extra]
        return checkpoint

    def _state_schema(self) -> Mapping[str, FieldSpec]:
        """The fields of this stage's state, with their validators (`_core.schema`):
        ``_state_fields``, plus those that only some instances write (a skip ledger)."""
        return self._state_fields

    def restore_source(self, source: Iterator[Any], state: State | None) -> None:
        """Set `source` (one of this stage's sources) to `state`; a mismatch error names
        the path through this stage (``MapIterator.source > ...``)."""
        try:
            if isinstance(source, Stage):
                source._set(state)
            elif isinstance(source, CheckpointableIterator):
                source.setstate(state)
        except StateMismatchError as error:
            raise error.within(f"{self._name}{step_to(self, source)}") from None

    def restore_sources(
        self, sources: Sequence[Iterator[Any]], states: list[Any] | None, where: str
    ) -> None:
        """Restore each of `sources` from `states` (None resets them all), the list held
        by the state's field `where`."""
        if states is not None and len(states) != len(sources):
            raise self.mismatch(
                f"the checkpoint holds {len(states)} {where} states, this stage has {len(sources)}"
            )
        for index, state in enumerate(states or ()):
            if not isinstance(state, dict):
                raise self.mismatch(f"{where}[{index}] must be a dict, got {state!r}")
        for index, source in enumerate(sources):
            self.restore_source(source, None if states is None else states[index])

    def _state_around(self, source: State) -> State:
        """This stage's state with its source (in `_source_field`) at `source` and
        nothing of it held or replayed here, for a wrapper stage that can give one (a
        background stage); a TypeError for others."""
        raise TypeError(f"{self._name} cannot give a state around its source's")

    @classmethod
    def _regrouped(cls, states: list[Any], regroup: Regroup) -> State:
        """This stage's state on a new number of ranks, from the states its old ranks
        saved (elastic restore, see `infinibatch_like._core.regroup`): by default, refused
        with `_not_elastic`, or, for a stage that declares itself elastic around its
        `_source_field`, this rank's old fields around the regrouped sources."""
        if cls._not_elastic is not None or cls._source_field is None:
            raise regroup.pooling.refuse(cls.__name__, cls._not_elastic or NOT_ELASTIC)
        return regroup.around(cls.__name__, cls._source_field, states)

    @abstractmethod
    def _state(self) -> State: ...

    @abstractmethod
    def _restore(self, state: State | None) -> None: ...

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Release background resources; `getstate` keeps returning the position here."""
        if self._closed:
            return
        try:
            self._closed_state = self._snapshot()
        except Exception as error:  # e.g. a stage that failed: getstate() will say so
            self._closed_reason = f"{type(error).__name__}: {error}"
        self._closed = True
        self._iterator = _Halted(f"{self._name} is closed", None)
        for source in self._sources:
            if isinstance(source, CheckpointableIterator):
                source.close()


RestoreObserver = Callable[[Stage[Any], bool], None]
"""Told of each restore of a stage: ``observer(stage, direct)`` (see `Stage._set`)."""

_RESTORE_OBSERVERS: list[RestoreObserver] = []


def observe_restores(observer: RestoreObserver) -> None:
    """Call `observer` after every restore of every stage, from now on."""
    _RESTORE_OBSERVERS.append(observer)


def _desync_consumers(stage: Stage[Any], direct: bool) -> None:
    """After a `setstate` called on `stage` itself: mark every stage downstream of it as no
    longer matching its source (their ``next()`` and ``getstate()`` raise until the
    outermost stage is restored)."""
    if not direct:
        return
    pending: list[Node] = [stage]
    while pending:
        for consumer in consumers_of(pending.pop()):
            if not isinstance(consumer, Stage) or consumer._closed or consumer._desync is not None:
                continue
            consumer._desync = (
                f"{consumer._name} no longer matches its source: {stage._name}, which it "
                f"consumes, was restored directly with {stage._name}.setstate(); restore "
                "the outermost stage (the one you iterate) instead, with "
                "pipeline.setstate(state) or pipeline.setstate(None)"
            )
            consumer._iterator = _Halted(consumer._desync, None)
            pending.append(consumer)


observe_restores(_desync_consumers)


def state_before_last(source: Iterator[Any]) -> State | None:
    """`source`'s state one item back (see `Stage._state_before_last`), if it can tell."""
    return source._state_before_last() if isinstance(source, Stage) else None


def skip_items(iterator: Iterator[Any], count: int, owner: str, what: str) -> None:
    """Pass over the `count` items of `iterator` that a checkpoint says were consumed
    (with its ``skip`` where it is a `SkippableIterator`), while the stage `owner` restores
    (or its worker replays); a StateMismatchError naming `owner` if it ends early."""
    if isinstance(iterator, SkippableIterator):
        skipped = iterator.skip(count)
        if skipped < count:
            raise StateMismatchError(
                f"the checkpoint skips {count} items of {what}, but there are only {skipped}",
                (owner,),
            )
        return
    for index in range(count):
        try:
            next(iterator)
        except StopIteration:
            raise StateMismatchError(
                f"the checkpoint skips {count} items of {what}, but there are only {index}",
                (owner,),
            ) from None
