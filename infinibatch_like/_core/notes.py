"""Which stage's user callable raised an error: found from the error's traceback.

A stage names the constructor parameters that take user callables in its class attribute
``_user_callables`` (e.g. ``("transform",)``). `raising_callables` matches the code objects
of the frames in an error's traceback with the code of those callables, so it finds the
stage even where no frame of the stage is on the stack (a `MapIterator` runs as a builtin
``map``). Only the error path pays for this: nothing is done per item.

`note_error` is what a pipeline's outermost stage calls when an error surfaces: it adds a
note such as ``(raised by MapIterator's transform parse on item 'x')`` (once per error) and
marks the stages whose callable consumed its item (``_loses_input_on_error``): their
``getstate`` then steps the source back one item, so that a restore re-attempts it, or
refuses where the source cannot step back.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, cast

from .graph import Node, sources_of, stages
from .names import callable_name, short_repr

if TYPE_CHECKING:
    from .stage import Stage

NOTE_PREFIX = "(raised "
"""The library's notes on errors start with this (so that an error is noted once)."""

_NO_ITEM: Any = object()


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``; on Python 3.10, appended to ``error.__notes__`` likewise
    (3.10's traceback printer does not show notes; the ``exceptiongroup`` backport does)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # pragma: no cover - exercised on 3.10 only
        notes = getattr(error, "__notes__", None)
        try:
            if isinstance(notes, list):
                notes.append(note)
            else:
                error.__notes__ = [note]  # type: ignore[attr-defined]
        except AttributeError:
            pass


def has_library_note(error: BaseException) -> bool:
    """Whether the library already noted where `error` was raised."""
    notes = getattr(error, "__notes__", ())
    return any(isinstance(note, str) and note.startswith(NOTE_PREFIX) for note in notes)


@dataclass(frozen=True)
class Raiser:
    """A user callable that raised: the stage holding it, its parameter name, the
    callable, and the item it was called on (`_NO_ITEM` when no frame tells it)."""

    stage: Stage[Any]
    param: str
    function: Callable[..., Any]
    item: Any = _NO_ITEM


def pipeline_stages(pipeline: object) -> list[Stage[Any]]:
    """The stages of `pipeline`, outermost first (each once)."""
    return cast("list[Stage[Any]]", stages(pipeline))


def user_callables(stage: Stage[Any]) -> list[tuple[str, Callable[..., Any]]]:
    """(parameter, callable) for each user callable `stage` was built with."""
    names: tuple[str, ...] = getattr(type(stage), "_user_callables", ())
    if not names:
        return []
    args, kwargs = stage._init_args
    try:
        bound = inspect.signature(type(stage).__init__).bind_partial(stage, *args, **kwargs)
    except TypeError:
        return []
    return [
        (name, value)
        for name in names
        if callable(value := bound.arguments.get(name)) and not isinstance(value, int)
    ]


def code_of(function: object) -> CodeType | None:
    """The code object that runs when `function` is called, if it is Python code:
    unwraps ``functools.partial``, bound methods and objects with a ``__call__``."""
    for _ in range(8):  # partial of a bound method of a callable object, and so on
        if isinstance(function, partial):
            function = function.func
        elif inspect.ismethod(function):
            function = function.__func__
        elif isinstance(code := getattr(function, "__code__", None), CodeType):
            return code
        elif inspect.isfunction(call := inspect.getattr_static(type(function), "__call__", None)):
            function = call
        else:
            return None
    return None


def raising_callables(pipeline: object, error: BaseException) -> list[Raiser]:
    """The user callables of `pipeline`'s stages that may have raised `error`.

    One entry where the traceback tells (several where stages share the callable and no
    frame tells them apart); none where no user callable of the pipeline raised it or a
    C callable cannot be told from others.
    """
    stages = pipeline_stages(pipeline)
    if not stages:
        return []
    stage_ids = {id(stage) for stage in stages}
    frames = _frames(error)
    by_code: dict[CodeType, list[tuple[Stage[Any], str, Callable[..., Any]]]] = {}
    c_callables: dict[int, list[tuple[Stage[Any], str, Callable[..., Any]]]] = {}
    for stage in stages:
        for param, function in user_callables(stage):
            code = code_of(function)
            if code is not None:
                by_code.setdefault(code, []).append((stage, param, function))
            else:
                c_callables.setdefault(id(stage), []).append((stage, param, function))
    enclosing: Stage[Any] | None = None
    for frame in frames:
        owner = _frame_stage(frame, stage_ids)
        if owner is not None:
            enclosing = owner
        candidates = by_code.get(frame.f_code)
        if candidates:
            item = _last_argument(frame)
            chosen = _closest(candidates, enclosing)
            return [Raiser(stage, param, function, item) for stage, param, function in chosen]
    if not frames:
        return []
    innermost = _frame_stage(frames[-1], stage_ids)
    if innermost is None:
        return []
    options = [entry for stage in _map_chain(innermost) for entry in c_callables.get(id(stage), [])]
    if len({id(function) for _, _, function in options}) != 1:
        return []
    return [Raiser(stage, param, function) for stage, param, function in options]


def callable_origin(pipeline: object, error: BaseException) -> str | None:
    """Which stage's user callable raised `error`, e.g. ``by MapIterator's transform parse
    on item 'x'``; None if unknown."""
    raisers = raising_callables(pipeline, error)
    if not raisers:
        return None
    first = raisers[0]
    return call_origin(first.stage._name, first.param, first.function, first.item, len(raisers))


def call_origin(
    stage: str, param: str, function: object, item: Any = _NO_ITEM, sharing: int = 1
) -> str:
    """``by MapIterator's transform parse on item 'x'``: the user function `function`, given
    to `stage` as `param` (and to `sharing` stages in all), raised on `item`."""
    shared = f", used by {sharing} stages," if sharing > 1 else ""
    on_item = "" if item is _NO_ITEM else f" on item {short_repr(item)}"
    return f"by {stage}'s {param} {callable_name(function)}{shared}{on_item}"


def callable_note(pipeline: object, error: BaseException) -> str | None:
    """A note naming the stage and parameter whose callable raised `error`, e.g.
    ``(raised by MapIterator's transform parse on item 'x')``; None if unknown."""
    origin = callable_origin(pipeline, error)
    return None if origin is None else f"{NOTE_PREFIX}{origin})"


def note_error(pipeline: object, error: BaseException) -> None:
    """Name the user callable that raised `error` in a note (unless the error has one),
    and mark the stages that took an input they cannot give back (their ``getstate``
    then raises). Never raises itself: the user's error is what matters."""
    try:
        raisers = raising_callables(pipeline, error)
        for raiser in raisers:
            if getattr(raiser.stage, "_loses_input_on_error", False):
                raiser.stage._lost_input = (
                    f"{raiser.stage._name}: its {raiser.param} raised "
                    f"{type(error).__name__}, so the item it was given is consumed from the "
                    "source and not yielded, and the source cannot step back to it: the "
                    "position after the error is not defined. Restore a checkpoint taken "
                    "before the error (setstate) to continue"
                )
        if not has_library_note(error) and (note := callable_note(pipeline, error)):
            add_note(error, note)
    except Exception:  # pragma: no cover - a bug here must not hide the user's error
        pass


def _frames(error: BaseException) -> list[FrameType]:
    frames = []
    trace = error.__traceback__
    while trace is not None:
        frames.append(trace.tb_frame)
        trace = trace.tb_next
    return frames


def _frame_stage(frame: FrameType, stage_ids: set[int]) -> Stage[Any] | None:
    owner: Any = frame.f_locals.get("self")
    return owner if id(owner) in stage_ids else None


def _last_argument(frame: FrameType) -> Any:
    """The last positional argument of a user callable's frame: the item for a
    ``transform(item)``, ``step_function(state, item)``, ``transform(rng, item)``, a
    bound method or a partial."""
    code = frame.f_code
    if code.co_argcount == 0:
        return _NO_ITEM
    return frame.f_locals.get(code.co_varnames[code.co_argcount - 1], _NO_ITEM)


def _closest(
    candidates: list[tuple[Stage[Any], str, Callable[..., Any]]], enclosing: Stage[Any] | None
) -> list[tuple[Stage[Any], str, Callable[..., Any]]]:
    """Of the stages holding the callable that raised, those that can have called it from
    the nearest stage frame above it (that stage, or a builtin ``map`` upstream of it that
    runs inside its pulls), else those upstream of that stage, else all."""
    if enclosing is None:
        return candidates
    for possible in (_map_chain(enclosing), pipeline_stages(enclosing)):
        ids = {id(stage) for stage in possible}
        chosen = [entry for entry in candidates if id(entry[0]) in ids]
        if chosen:
            return chosen
    return candidates


def _map_chain(stage: Stage[Any]) -> Iterator[Stage[Any]]:
    """`stage`, then the upstream stages that run inside its pulls as builtin ``map``s
    (or ``filter``s)."""
    yield stage
    current: object = stage
    while len(upstream := sources_of(current)) == 1 and isinstance(upstream[0], Node):
        current = cast("Stage[Any]", upstream[0])
        if type(current._iterator) not in (map, filter):
            return
        yield current
