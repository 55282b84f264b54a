"""The conformance checker of the checkpoint contract of `CheckpointableIterator`s.

``assert_checkpointable(factory)`` builds fresh pipelines with `factory` and checks, for
the pipeline and every stage in it, the contract of ``docs/concepts.md``:

- C1 ``getstate()`` does not advance the iterator and its result does not change later;
- C2 a state taken after k items makes a fresh pipeline yield items k, k+1, ...;
- C3 ``setstate(None)`` equals a fresh construction;
- C4 ``getstate()`` right after ``setstate(s)`` equals s, also when the caller added keys
  of its own to s, at the top level and inside nested stage states (they are ignored);
- C5 the state has the same shape (keys and value types) at every step;
- C6 states are plain data that survive ``json`` and ``torch.load(weights_only=True)``;
- C7 exhaustion is sticky and a state taken at the end restores to "exhausted";
- C8 ``close()`` is idempotent, ``next()`` raises after it, no thread or process outlives it,
  and ``getstate()`` after it (e.g. after a ``with`` block) either raises or returns the
  true position, from which a fresh pipeline continues;
- C9 states are snapshots: emptying the dict returned by ``getstate()``, or the dict given
  to ``setstate()``, changes neither what the pipeline yields nor what it reports;
- C10 with ``different=``, a factory of the same pipeline built with other stream-deciding
  arguments (another item list, block size, ...), a state of one is refused by the other
  with a ValueError naming a stage;
- C11 damaged states (each count set to 10**18, 2**64 or -1, each number replaced by a str,
  a float, a bool or None) are refused with a ValueError or TypeError naming a stage, or
  restored, within `deadline` seconds for the restore and the next items: never a hang,
  never another exception;

and that a state of another pipeline is refused with a ValueError naming the stage; that
restoring an inner stage directly (``inner.setstate(s)`` on the source of the outermost
stage) never leaves the outer stage silently yielding a stream that does not match its
``getstate()`` (it either follows, or raises); and that a pipeline pickled mid-stream
continues where it was.

``check_resume(factory)`` is the end-to-end check of a training loop's resumes: one
uninterrupted run against runs interrupted at several points and restored, after a JSON
and a ``torch.load(weights_only=True)`` round trip of the state, into fresh pipelines.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from .._core.graph import walk
from .._core.protocol import CheckpointableIterator, State

Factory = Callable[[], CheckpointableIterator[Any]]

_PLAIN_SCALARS = (str, int, float, bool, type(None))


class ContractViolation(AssertionError):
    """A checkpoint-contract rule does not hold; the message names the rule."""


class ResumeMismatch(ContractViolation):
    """A restored pipeline does not continue the uninterrupted stream (see `check_resume`).

    Attributes:
        restore_point: how many items the interrupted run had taken when its state was saved.
        round_trip: how the state travelled (``"original"``, ``"JSON round-tripped"``,
            ``"torch.load(weights_only=True)"``, or ``"chained"`` for the run restored at
            every point in turn).
        index: the stream position of the first differing item (None if restoring raised).
        expected: the uninterrupted run's item there (None past its end).
        got: the restored pipeline's item there (None if it ended early).
    """

    def __init__(
        self,
        message: str,
        restore_point: int,
        round_trip: str,
        index: int | None,
        expected: Any = None,
        got: Any = None,
    ) -> None:
        super().__init__(message)
        self.restore_point, self.round_trip, self.index = restore_point, round_trip, index
        self.expected, self.got = expected, got


def assert_checkpointable(
    factory: Factory,
    *,
    max_items: int = 60,
    restore_points: Sequence[int] | None = None,
    continuation: int = 20,
    same: Callable[[Any, Any], bool] | None = None,
    check_pickle: bool = True,
    check_torch: bool = True,
    different: Factory | None = None,
    check_damage: bool = True,
    deadline: float = 10.0,
    user_data_keys: Collection[str] = ("recurrent_state", "buffer"),
) -> None:
    """Check the checkpoint contract on pipelines built by `factory`.

    Args:
        factory: builds a fresh pipeline each call (fresh sources too), deterministically.
        max_items: how many items of the stream to examine (fewer if it ends).
        restore_points: positions k whose states are restored into fresh pipelines; by
            default all of them up to 64, else 64 spread evenly, plus the end.
        continuation: items compared after each restore (the first, middle and last
            restore points are compared up to `max_items`).
        same: item equality (default ``==``, applied recursively to lists and tuples by
            Python itself).
        check_pickle: also pickle a pipeline mid-stream and continue from the copy.
        check_torch: also round-trip states through ``torch.save``/``torch.load(...,
            weights_only=True)`` when torch is installed.
        different: builds the same pipeline with other stream-deciding arguments, whose
            states must not fit the pipelines of `factory` (C10); None skips the check.
        check_damage: restore damaged states (C11).
        deadline: seconds that a restore of one damaged state and the next items may take.
            A restore that overruns it is left running in a daemon thread (Python cannot
            stop a thread), so a hang found this way can slow the rest of a test session.
        user_data_keys: state keys whose values are the user's data (items held, recurrent
            states), handed to user code as they are: C11 does not damage them.

    Raises:
        ContractViolation: naming the rule that failed, the position and the details.
    """
    equal = same or _default_same
    threads_before = set(threading.enumerate())
    children_before = set(multiprocessing.active_children())
    reference = _take(factory(), max_items)
    ended = len(reference) < max_items

    pipeline = factory()
    states: list[State] = []
    frozen: list[str] = []
    items: list[Any] = []
    for position in range(len(reference) + 1):
        state = pipeline.getstate()
        _check_plain(state, position)
        states.append(state)
        frozen.append(json.dumps(state, sort_keys=True))
        if position < len(reference):
            items.append(next(pipeline))
    _require(
        _all_same(items, reference, equal),
        "C1",
        "calling getstate() between items changed the stream",
    )
    for position, (state, dumped) in enumerate(zip(states, frozen, strict=True)):
        _require(
            json.dumps(state, sort_keys=True) == dumped,
            "C1",
            f"the state taken at item {position} changed as iteration went on",
        )
        _require(
            _shape(state) == _shape(states[0]),
            "C5",
            f"the state's shape at item {position} differs from the one at item 0:\n"
            f"{_shape(state)}\n!=\n{_shape(states[0])}",
        )
    if ended:
        _check_sticky_end(pipeline, len(reference))

    points = _restore_points(len(reference), restore_points)
    long_points = {points[0], points[len(points) // 2], points[-1]}
    for position in points:
        remaining = len(reference) - position
        length = remaining if position in long_points else min(continuation, remaining)
        expected = reference[position : position + length]
        variants = _variants(states[position], check_torch)
        if position in long_points:
            extended = {**_with_caller_keys(states[position]), "epoch": 3, "iterations_in_epoch": 7}
            variants.append(("caller-extended", extended))
        for label, state in variants:
            fresh = factory()
            try:
                fresh.setstate(state)
            except ValueError as error:
                raise ContractViolation(
                    f"C4: the {label} state of item {position} was refused: {error}"
                ) from error
            _require(
                json.dumps(fresh.getstate(), sort_keys=True) == frozen[position],
                "C4",
                f"getstate() right after setstate() of the {label} state of item {position} "
                "differs from that state",
            )
            got = _take(fresh, length)
            _require(
                _all_same(got, expected, equal),
                "C2",
                f"a fresh pipeline restored from the {label} state of item {position} "
                f"yields {_preview(got)}, expected {_preview(expected)}",
            )
            if ended and position + length == len(reference):
                _check_sticky_end(fresh, len(reference))
            fresh.close()

    # Restores into one instance, in reverse order and after a reset (C2, C3).
    for position in reversed(points):
        pipeline.setstate(copy.deepcopy(states[position]))
        expected = reference[position : position + continuation]
        got = _take(pipeline, len(expected))
        _require(
            _all_same(got, expected, equal),
            "C2",
            f"the pipeline reused for a restore to item {position} yields {_preview(got)}, "
            f"expected {_preview(expected)}",
        )
    pipeline.setstate(None)
    got = _take(pipeline, len(reference))
    _require(
        _all_same(got, reference, equal),
        "C3",
        f"after setstate(None) the pipeline yields {_preview(got)}, expected {_preview(reference)}",
    )

    middle = len(reference) // 2
    _check_foreign_state(factory)
    _check_snapshots(factory, reference, middle, equal)
    _check_closed_state(factory, reference, middle, equal)
    _check_inner_restore(factory, reference, equal)
    if different is not None:
        _check_different(factory, different, middle)
    if check_damage:
        _check_damage(factory, states[middle], deadline, set(user_data_keys))
    if check_pickle:
        _check_pickle(factory, reference, equal)
    _check_close(pipeline, threads_before, children_before)


def check_resume(
    factory: Factory,
    *,
    max_items: int = 200,
    restore_points: int | Sequence[int] = 8,
    same: Callable[[Any, Any], bool] | None = None,
    check_torch: bool = True,
) -> None:
    """Check that runs interrupted and restored yield the uninterrupted run's stream.

    Run this on your own pipeline, the way your training loop builds, saves and restores
    it. One run of `max_items` items from ``factory()`` is the reference. For each restore
    point k, a second pipeline takes k items, saves its state and is closed (the
    interruption); the state, as it is, after a JSON round trip and after a ``torch.save``
    / ``torch.load(weights_only=True)`` round trip, is restored into a fresh pipeline from
    `factory`, whose items must be the reference's items k, k+1, ... to the end (and end
    where it ends). Finally one chained run is interrupted at every restore point in turn,
    each time resumed by a fresh pipeline from the state of the previous one.

    Args:
        factory: builds the pipeline, fresh and deterministic, each call (fresh sources
            too, e.g. a new `chunked_dataset_iterator`).
        max_items: the length of the compared stream (fewer if the stream ends).
        restore_points: the positions to interrupt at, or how many positions to spread
            evenly over the stream (0 and the end included).
        same: item equality (default ``==`` and the same type; give one for items such as
            numpy arrays or tensors).
        check_torch: also round-trip the state through torch when torch is installed.

    Raises:
        ResumeMismatch: (a `ContractViolation`) for the first restore point and round trip
            whose resumed stream differs, naming the point, the round trip, the first
            differing item's index and previews of the expected and received items; or
            whose restore raised.
    """
    equal = same or _default_same
    with factory() as pipeline:
        reference = _take(pipeline, max_items)
    ended = len(reference) < max_items
    if isinstance(restore_points, int):
        points = _restore_points(len(reference), None, spread=restore_points)
    else:
        points = _restore_points(len(reference), restore_points)
    for point in points:
        with factory() as interrupted:
            _take(interrupted, point)
            state = interrupted.getstate()
        for label, variant in _variants(state, check_torch):
            _resume(factory, variant, point, label, reference, len(reference), ended, equal)
    _check_chained_resumes(factory, points, reference, ended, check_torch, equal)


def _check_chained_resumes(
    factory: Factory,
    points: Sequence[int],
    reference: Sequence[Any],
    ended: bool,
    check_torch: bool,
    equal: Callable[[Any, Any], bool],
) -> None:
    """One run interrupted at every point in turn, each time resumed by a fresh pipeline."""
    state: State | None = None
    position = 0
    for turn, point in enumerate(sorted({*points, len(reference)} - {0})):
        state = _resume(factory, state, position, "chained", reference, point, ended, equal)
        variants = _variants(state, check_torch)
        state, position = variants[turn % len(variants)][1], point


def _resume(
    factory: Factory,
    state: State | None,
    point: int,
    label: str,
    reference: Sequence[Any],
    end: int,
    ended: bool,
    equal: Callable[[Any, Any], bool],
) -> State:
    """Restore `state` (saved at `point`) into a fresh pipeline, compare up to `end`."""
    with factory() as fresh:
        try:
            fresh.setstate(state)
        except Exception as error:
            raise ResumeMismatch(
                f"check_resume: restoring the {label} state saved at item {point} raised "
                f"{type(error).__name__}: {error}",
                point,
                label,
                None,
            ) from error
        extra = 1 if ended and end == len(reference) else 0
        got = _take(fresh, end - point + extra)
        expected = reference[point:end]
        if not _all_same(got, expected, equal):
            _report_difference(point, label, got, expected, equal)
        return fresh.getstate()


def _report_difference(
    point: int,
    label: str,
    got: Sequence[Any],
    expected: Sequence[Any],
    equal: Callable[[Any, Any], bool],
) -> None:
    offset = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if not equal(a, b)),
        min(len(got), len(expected)),
    )
    index = point + offset
    expected_item = expected[offset] if offset < len(expected) else None
    got_item = got[offset] if offset < len(got) else None
    if offset >= len(got):
        what = f"ended after {len(got)} items, expected {expected_item!r}"
    elif offset >= len(expected):
        what = f"yielded {got_item!r} where the uninterrupted run ended"
    else:
        what = f"expected {expected_item!r}, got {got_item!r}"
    raise ResumeMismatch(
        f"check_resume: a fresh pipeline restored from the {label} state saved at item "
        f"{point} differs from the uninterrupted run at item {index}: {what}\n"
        f"  expected from item {index}: {_preview(expected[offset:])}\n"
        f"  got from item {index}:      {_preview(got[offset:])}",
        point,
        label,
        index,
        expected_item,
        got_item,
    )


def _default_same(a: Any, b: Any) -> bool:
    return bool(a == b) and type(a) is type(b)


def _all_same(
    got: Sequence[Any], expected: Sequence[Any], equal: Callable[[Any, Any], bool]
) -> bool:
    return len(got) == len(expected) and all(map(equal, got, expected))


def _take(iterator: CheckpointableIterator[Any], count: int) -> list[Any]:
    return list(itertools.islice(iterator, count))


def _preview(items: Sequence[Any]) -> str:
    text = repr(list(items[:6]))
    return text if len(items) <= 6 else f"{text[:-1]}, ... ({len(items)} items)]"


def _require(condition: bool, rule: str, message: str) -> None:
    if not condition:
        raise ContractViolation(f"{rule}: {message}")


def _restore_points(length: int, chosen: Sequence[int] | None, spread: int = 64) -> list[int]:
    """The chosen points within the stream, or `spread` points evenly spread and the end."""
    if chosen is not None:
        return sorted({point for point in chosen if 0 <= point <= length})
    if length <= spread:
        return list(range(length + 1))
    step = length / spread
    return sorted({round(index * step) for index in range(spread)} | {length})


def _check_plain(value: Any, position: int, path: str = "state") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _require(
                isinstance(key, str), "C6", f"{path} has a non-str key {key!r} at item {position}"
            )
            _check_plain(item, position, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_plain(item, position, f"{path}[{index}]")
    else:
        _require(
            isinstance(value, _PLAIN_SCALARS),
            "C6",
            f"{path} holds a {type(value).__name__} at item {position}; states must be dicts, "
            "lists, str, int, float, bool or None",
        )


def _shape(value: Any) -> Any:
    """Keys and value types; None fits any type, lists of stage states are compared."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(item, dict) and "stage" in item for item in value):
            return [_shape(item) for item in value]
        return "list"
    if value is None:
        return _AnyType()
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


class _AnyType:
    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "None"


def _variants(state: State, check_torch: bool) -> list[tuple[str, State]]:
    variants: list[tuple[str, State]] = [
        ("original", state),
        ("JSON round-tripped", json.loads(json.dumps(state))),
    ]
    if check_torch:
        try:
            import torch
        except ImportError:
            return variants
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        variants.append(("torch.load(weights_only=True)", torch.load(buffer, weights_only=True)))
    return variants


def _check_sticky_end(iterator: CheckpointableIterator[Any], length: int) -> None:
    for _ in range(2):
        try:
            item = next(iterator)
        except StopIteration:
            continue
        raise ContractViolation(f"C7: the stream ended after {length} items, then yielded {item!r}")


def _check_foreign_state(factory: Factory) -> None:
    pipeline = factory()
    name = type(pipeline).__name__
    foreigns: list[Any] = [{"stage": "NoSuchStage"}, {"stage": name, "unexpected": 1}, []]
    for foreign in foreigns:
        try:
            pipeline.setstate(foreign)
        except ValueError as error:
            _require(
                name in str(error),
                "foreign state",
                f"the error for a foreign state does not name the stage {name}: {error}",
            )
        else:
            raise ContractViolation(f"foreign state: {name} accepted the state {foreign!r}")
    pipeline.close()


def _with_caller_keys(state: Any) -> Any:
    """`state` with keys a caller might add: at the top (``epoch``) and in nested states."""
    if isinstance(state, dict):
        extended = {key: _with_caller_keys(value) for key, value in state.items()}
        if "stage" in state:
            extended["added_by_caller"] = {"note": [1, "x"]}
        return extended
    if isinstance(state, list):
        return [_with_caller_keys(value) for value in state]
    return state


def _emptied(value: Any) -> None:
    """Empty every dict and list in `value`, in place."""
    if isinstance(value, (dict, list)):
        for item in list(value.values() if isinstance(value, dict) else value):
            _emptied(item)
        value.clear()


def _dumped(state: Any) -> str:
    return json.dumps(state, sort_keys=True)


def _check_snapshots(
    factory: Factory, reference: Sequence[Any], middle: int, equal: Callable[[Any, Any], bool]
) -> None:
    pipeline = factory()
    _take(pipeline, middle)
    returned = pipeline.getstate()
    kept = _dumped(returned)
    _emptied(returned)
    _require(
        _dumped(pipeline.getstate()) == kept,
        "C9",
        f"emptying the dict returned by getstate() at item {middle} changed the pipeline's state",
    )
    given = json.loads(kept)
    fresh = factory()
    fresh.setstate(given)
    _emptied(given)
    _require(
        _dumped(fresh.getstate()) == kept,
        "C9",
        f"emptying the dict given to setstate() (item {middle}) changed the pipeline's state",
    )
    for label, iterator in (("getstate()", pipeline), ("setstate()", fresh)):
        _require_continuation(
            iterator,
            reference,
            middle,
            equal,
            "C9",
            f"after emptying the dict given to or returned by {label} at item {middle}, the "
            "pipeline",
        )
        iterator.close()


def _require_continuation(
    iterator: CheckpointableIterator[Any],
    reference: Sequence[Any],
    start: int,
    equal: Callable[[Any, Any], bool],
    rule: str,
    what: str,
) -> None:
    """Require `iterator` to yield ``reference[start:]``; else a violation of `rule`."""
    got = _take(iterator, len(reference) - start)
    _require(
        _all_same(got, reference[start:], equal),
        rule,
        f"{what} yields {_preview(got)}, expected {_preview(reference[start:])}",
    )


def _check_closed_state(
    factory: Factory, reference: Sequence[Any], middle: int, equal: Callable[[Any, Any], bool]
) -> None:
    with factory() as pipeline:
        _take(pipeline, middle)
    try:
        state = pipeline.getstate()
    except RuntimeError:
        return  # raising is allowed; a wrong position is not
    fresh = factory()
    fresh.setstate(state)
    _require_continuation(
        fresh,
        reference,
        middle,
        equal,
        "C8",
        f"a pipeline restored from the state returned by getstate() after closing at item {middle}",
    )
    fresh.close()


def _inner_stage(pipeline: CheckpointableIterator[Any]) -> CheckpointableIterator[Any] | None:
    """The first checkpointable source of `pipeline`, if it has one."""
    return next((place.stage for place in walk(pipeline) if place.parent is not None), None)


def _check_inner_restore(
    factory: Factory, reference: Sequence[Any], equal: Callable[[Any, Any], bool]
) -> None:
    pipeline = factory()
    inner = _inner_stage(pipeline)
    if inner is None or len(reference) < 4:
        pipeline.close()
        return
    _take(pipeline, len(reference) // 4)
    early = inner.getstate()
    _take(pipeline, len(reference) // 4)
    inner.setstate(early)
    try:
        state = pipeline.getstate()
        got = _take(pipeline, 10)
    except (RuntimeError, ValueError):
        pipeline.close()
        return  # a clear refusal to go on
    fresh = factory()
    fresh.setstate(state)
    expected = _take(fresh, len(got))
    fresh.close()
    pipeline.close()
    _require(
        _all_same(got, expected, equal),
        "inner restore",
        f"after setstate() on the pipeline's source {type(inner).__name__}, the pipeline "
        f"yields {_preview(got)} while its getstate() describes {_preview(expected)}; it "
        "must follow its source or raise",
    )


def _check_different(factory: Factory, different: Factory, middle: int) -> None:
    pipeline = factory()
    _take(pipeline, middle)
    state = pipeline.getstate()
    pipeline.close()
    other = different()
    names = _stage_names(state) | {type(other).__name__}
    try:
        other.setstate(state)
    except ValueError as error:
        _require(
            any(name in str(error) for name in names),
            "C10",
            f"the error for a state of a differently built pipeline names no stage: {error}",
        )
    else:
        raise ContractViolation(
            "C10: a pipeline built with other stream-deciding arguments accepted a state of "
            f"the original one (item {middle})"
        )
    finally:
        other.close()


def _stage_names(state: Any) -> set[str]:
    if isinstance(state, dict):
        names = {state["stage"]} if isinstance(state.get("stage"), str) else set()
        for value in state.values():
            names |= _stage_names(value)
        return names
    if isinstance(state, list):
        return set().union(*(_stage_names(value) for value in state))
    return set()


_HUGE_COUNTS = (10**18, 2**64, -1)
_WRONG_TYPES: tuple[Any, ...] = ("7", 1.5, True, None)


def _damaged(state: Any, user_data_keys: set[str]) -> Iterator[tuple[str, Any]]:
    """(description, damaged copy of `state`) for each number in it and each damage."""
    for path, value in _numbers(state, (), user_data_keys):
        replacements = (*_HUGE_COUNTS, *_WRONG_TYPES) if type(value) is int else _WRONG_TYPES
        for replacement in replacements:
            if type(replacement) is type(value) and replacement == value:
                continue
            damaged = copy.deepcopy(state)
            container = damaged
            for key in path[:-1]:
                container = container[key]
            container[path[-1]] = replacement
            where = "".join(f"[{key!r}]" for key in path)
            yield f"state{where} = {replacement!r}", damaged


def _numbers(
    value: Any, path: tuple[Any, ...], user_data_keys: set[str]
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in user_data_keys:
                yield from _numbers(item, (*path, key), user_data_keys)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, (*path, index), user_data_keys)
    elif isinstance(value, (int, float)) and type(value) is not bool:
        yield path, value


def _check_damage(
    factory: Factory, state: State, deadline: float, user_data_keys: set[str]
) -> None:
    names = _stage_names(state)
    for description, damaged in _damaged(state, user_data_keys):
        pipeline = factory()
        names.add(type(pipeline).__name__)
        finished, error = _within(deadline, _restore_and_take, pipeline, damaged)
        _require(
            finished,
            "C11",
            f"restoring a damaged state ({description}) and taking 3 items did not finish "
            f"within {deadline} s",
        )
        pipeline.close()
        if error is None:
            continue
        _require(
            isinstance(error, (ValueError, TypeError)),
            "C11",
            f"a damaged state ({description}) raised {type(error).__name__}: {error}; expected "
            "a ValueError (e.g. StateMismatchError) or TypeError naming the stage",
        )
        _require(
            any(name in str(error) for name in names),
            "C11",
            f"the error for a damaged state ({description}) names no stage: {error}",
        )


def _restore_and_take(pipeline: CheckpointableIterator[Any], state: Any) -> None:
    pipeline.setstate(state)
    _take(pipeline, 3)


def _within(
    deadline: float, action: Callable[..., None], *args: Any
) -> tuple[bool, BaseException | None]:
    """Run ``action(*args)`` in a thread: (whether it finished in time, what it raised)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            action(*args)
        except BaseException as error:
            raised.append(error)

    worker = threading.Thread(target=run, name="assert_checkpointable.deadline", daemon=True)
    worker.start()
    worker.join(deadline)
    return not worker.is_alive(), (raised[0] if raised else None)


def _check_pickle(
    factory: Factory, reference: Sequence[Any], equal: Callable[[Any, Any], bool]
) -> None:
    pipeline = factory()
    middle = len(reference) // 2
    _take(pipeline, middle)
    copied = pickle.loads(pickle.dumps(pipeline))
    _require_continuation(
        copied, reference, middle, equal, "pickle", f"a pipeline pickled at item {middle}"
    )
    copied.close()
    pipeline.close()


def _check_close(
    pipeline: CheckpointableIterator[Any],
    threads_before: set[threading.Thread],
    children_before: set[Any],
) -> None:
    pipeline.close()
    pipeline.close()
    try:
        next(pipeline)
    except StopIteration:
        raise ContractViolation("C8: next() after close() raised StopIteration") from None
    except Exception:  # any error is the expected outcome
        pass
    else:
        raise ContractViolation("C8: next() after close() returned an item")
    leaked = [thread for thread in threading.enumerate() if thread not in threads_before]
    _require(not leaked, "C8", f"threads outlive close(): {leaked}")
    children = [
        child for child in multiprocessing.active_children() if child not in children_before
    ]
    _require(not children, "C8", f"processes outlive close(): {children}")
