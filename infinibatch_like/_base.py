"""The checkpointable-iterator protocol and the machinery every stage shares.

A pipeline is a chain of stages. Each stage keeps its items flowing through a plain
Python iterator (``_iterator``: a builtin ``map``/``zip``, a list iterator or a
generator). A downstream stage pulls from its source's ``_iterator`` directly, so the
per-item path of a chain crosses no Python-level ``__next__`` except the outermost one.
States are computed on demand from what each stage tracks, never pickled.
"""

from __future__ import annotations

import collections.abc
import contextlib
import inspect
import pickle
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

T = TypeVar("T")
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


def require_checkpointable(owner: str, param: str, value: object) -> None:
    """Raise ValueError unless `value` is a CheckpointableIterator."""
    if not isinstance(value, CheckpointableIterator):
        raise ValueError(
            f"{owner}: {param} must be a CheckpointableIterator, got {type(value).__name__}"
        )


def require_int(owner: str, param: str, value: object, minimum: int) -> int:
    """Return `value` if it is an int >= `minimum`, else raise TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {param} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {param} must be >= {minimum}, got {value}")
    return value


def require_callable(owner: str, param: str, value: object) -> None:
    """Raise TypeError unless `value` is callable."""
    if not callable(value):
        raise TypeError(f"{owner}: {param} must be callable, got {value!r}")


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


class Stage(CheckpointableIterator[T]):
    """Base class of this library's stages: state checks, failure, close and pickling.

    A subclass sets ``_sources`` (its upstream iterators), ``_state_fields`` (the keys of
    its state besides ``"stage"`` and the type each value must have) and implements
    ``_state()`` and ``_restore(state | None)``. ``_restore`` puts the upstream chain into
    place (through `restore_source`) and rebuilds ``_iterator``.

    Checkpoint:
        ``{"stage": <class name>, **fields}``; the fields are the subclass's.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {}
    _iterator: Iterator[T]
    _sources: tuple[Iterator[Any], ...] = ()
    _closed: bool = False
    _init_args: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> Stage[T]:
        self = super().__new__(cls)
        self._init_args = (args, kwargs)
        return self

    @property
    def _name(self) -> str:
        return type(self).__name__

    # -- iteration ---------------------------------------------------------------------

    def __next__(self) -> T:
        try:
            return next(self._iterator)
        except StopIteration:
            raise
        except BaseException as error:
            if not self._closed:
                self._iterator = _Halted(
                    f"{self._name} stopped after an error ({type(error).__name__}: {error}); "
                    "call setstate() with a checkpoint to continue",
                    error,
                )
            raise

    # -- checkpoints -------------------------------------------------------------------

    def getstate(self) -> State:
        return {"stage": self._name, **self._state()}

    def setstate(self, checkpoint: State | None) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name}.setstate: the iterator is closed")
        self._restore(None if checkpoint is None else self._checked(checkpoint))

    def _checked(self, checkpoint: object) -> State:
        if not isinstance(checkpoint, dict):
            raise self.mismatch(f"expected a dict, got {type(checkpoint).__name__}")
        stage = checkpoint.get("stage")
        if stage != self._name:
            raise self.mismatch(f"expected a state of {self._name}, got one of {stage!r}")
        expected = set(self._state_fields) | {"stage"}
        if set(checkpoint) != expected:
            missing = sorted(expected - set(checkpoint))
            extra = sorted(set(checkpoint) - expected)
            raise self.mismatch(f"state keys differ: missing {missing}, unexpected {extra}")
        for key, kind in self._state_fields.items():
            value = checkpoint[key]
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
                raise self.mismatch(
                    f"state field {key!r} has type {type(value).__name__}, "
                    f"expected {getattr(kind, '__name__', kind)}"
                )
        return checkpoint

    def restore_source(self, source: Iterator[Any], state: State | None, where: str) -> None:
        """Set `source` to `state`, naming `where` (e.g. ``"source"``) in mismatch errors."""
        try:
            if isinstance(source, CheckpointableIterator):
                source.setstate(state)
        except StateMismatchError as error:
            raise error.within(f"{self._name}.{where}") from None

    def restore_sources(
        self, sources: Sequence[Iterator[Any]], states: list[Any] | None, where: str
    ) -> None:
        """Restore each of `sources` from `states` (None resets them all)."""
        if states is not None and len(states) != len(sources):
            raise self.mismatch(
                f"the checkpoint holds {len(states)} {where} states, this stage has {len(sources)}"
            )
        for index, source in enumerate(sources):
            self.restore_source(
                source, None if states is None else states[index], f"{where}[{index}]"
            )

    def mismatch(self, reason: str) -> StateMismatchError:
        """A StateMismatchError raised by this stage itself."""
        return StateMismatchError(reason, (self._name,))

    @abstractmethod
    def _state(self) -> State: ...

    @abstractmethod
    def _restore(self, state: State | None) -> None: ...

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._iterator = _Halted(f"{self._name} is closed", None)
        for source in self._sources:
            if isinstance(source, CheckpointableIterator):
                source.close()

    # -- pickling: rebuild from the constructor arguments, then restore the state --------

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if self._closed:
            raise pickle.PicklingError(f"cannot pickle {self._name}: it is closed")
        self._check_picklable_callables(protocol)
        args, kwargs = self._init_args
        return (
            _rebuild,
            (type(self), _unrestored(args), _unrestored(kwargs), self.getstate()),
        )

    def _check_picklable_callables(self, protocol: Any) -> None:
        args, kwargs = self._init_args
        signature = inspect.signature(type(self).__init__)
        named = signature.bind_partial(self, *args, **kwargs).arguments
        for param, value in list(named.items())[1:]:
            if callable(value) and not isinstance(value, (type, CheckpointableIterator)):
                try:
                    getattr(_PICKLING, "dumps", pickle.dumps)(value, protocol)
                except Exception as error:
                    raise pickle.PicklingError(
                        f"cannot pickle {self._name}: its {param} {value!r} cannot be pickled "
                        f"({error}); use a module-level function or functools.partial"
                    ) from error


_PICKLING = threading.local()


@contextlib.contextmanager
def callable_pickling(dumps: Callable[[Any, Any], bytes]) -> Iterator[None]:
    """Within this block, stages being pickled check their callables with `dumps` (e.g.
    ``cloudpickle.dumps``, which pickles lambdas) instead of plain pickle."""
    _PICKLING.dumps = dumps
    try:
        yield
    finally:
        del _PICKLING.dumps


class _Unrestored:
    """Pickles a source stage without its state (the outer stage restores the chain)."""

    def __init__(self, stage: Stage[Any]) -> None:
        self.stage = stage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stage = self.stage
        stage._check_picklable_callables(protocol)
        args, kwargs = stage._init_args
        return (_rebuild, (type(stage), _unrestored(args), _unrestored(kwargs), None))


def _unrestored(value: Any) -> Any:
    if isinstance(value, Stage):
        return _Unrestored(value)
    if type(value) in (list, tuple) and any(isinstance(item, Stage) for item in value):
        return type(value)(_unrestored(item) for item in value)
    if type(value) is dict and any(isinstance(item, Stage) for item in value.values()):
        return {key: _unrestored(item) for key, item in value.items()}
    return value


def _rebuild(
    cls: Callable[..., Stage[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    state: State | None,
) -> Stage[Any]:
    stage = cls(*args, **kwargs)
    if state is not None:
        stage.setstate(state)
    return stage


def skip_items(stage: Stage[Any], iterator: Iterator[Any], n: int, what: str) -> None:
    """Skip `n` items of `iterator` while `stage` restores; a mismatch if it ends early."""
    for index in range(n):
        try:
            next(iterator)
        except StopIteration:
            raise stage.mismatch(
                f"the checkpoint skips {n} items of {what}, but there are only {index}"
            ) from None
