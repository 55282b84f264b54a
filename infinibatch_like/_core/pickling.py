"""Pickling a stage: it is rebuilt from its constructor arguments, then restored to its state.

Its source stages travel as arguments, rebuilt without their states (the outer stage's
state restores the whole chain). A user callable that plain pickle cannot send (a lambda)
is refused with an error naming the stage and the parameter, unless the stages are pickled
within `callable_pickling` (e.g. with ``cloudpickle.dumps``).
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from .protocol import CheckpointableIterator, State

T_co = TypeVar("T_co", covariant=True)


class Rebuildable(CheckpointableIterator[T_co]):
    """A checkpointable iterator that pickles as its constructor call and its state (the
    base of `Stage`, which records the arguments it was built with)."""

    _init_args: tuple[tuple[Any, ...], dict[str, Any]]
    _closed: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> Rebuildable[T_co]:
        self = super().__new__(cls)
        self._init_args = (args, kwargs)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if self._closed:
            raise pickle.PicklingError(f"cannot pickle {type(self).__name__}: it is closed")
        self._check_picklable_callables(protocol)
        return _rebuilt(self, self.getstate())

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
                        f"cannot pickle {type(self).__name__}: its {param} {value!r} cannot be "
                        f"pickled ({error}); use a module-level function or functools.partial"
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

    def __init__(self, stage: Rebuildable[Any]) -> None:
        self.stage = stage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        self.stage._check_picklable_callables(protocol)
        return _rebuilt(self.stage, None)


def _rebuilt(stage: Rebuildable[Any], state: State | None) -> tuple[Any, ...]:
    """How pickle rebuilds `stage`: from its constructor arguments, restored to `state`,
    with the argument labels its builder gave it."""
    args, kwargs = stage._init_args
    rebuild = (_rebuild, (type(stage), _unrestored(args), _unrestored(kwargs), state))
    labels: Mapping[str, str] | None = stage.__dict__.get("_argument_labels")
    return rebuild if labels is None else (*rebuild, {"_argument_labels": dict(labels)})


def _unrestored(value: Any) -> Any:
    if isinstance(value, Rebuildable):
        return _Unrestored(value)
    if type(value) in (list, tuple) and any(isinstance(item, Rebuildable) for item in value):
        return type(value)(_unrestored(item) for item in value)
    if type(value) is dict and any(isinstance(item, Rebuildable) for item in value.values()):
        return {key: _unrestored(item) for key, item in value.items()}
    return value


def _rebuild(
    cls: Callable[..., Rebuildable[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    state: State | None,
) -> Rebuildable[Any]:
    stage = cls(*args, **kwargs)
    if state is not None:
        stage.setstate(state)
    return stage
