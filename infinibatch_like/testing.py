"""A public conformance checker for the checkpoint contract of `CheckpointableIterator`s.

``assert_checkpointable(factory)`` builds fresh pipelines with `factory` and checks, for
the pipeline and every stage in it, the contract of ``docs/concepts.md``:

- C1 ``getstate()`` does not advance the iterator and its result does not change later;
- C2 a state taken after k items makes a fresh pipeline yield items k, k+1, ...;
- C3 ``setstate(None)`` equals a fresh construction;
- C4 ``getstate()`` right after ``setstate(s)`` equals s;
- C5 the state has the same shape (keys and value types) at every step;
- C6 states are plain data that survive ``json`` and ``torch.load(weights_only=True)``;
- C7 exhaustion is sticky and a state taken at the end restores to "exhausted";
- C8 ``close()`` is idempotent, ``next()`` raises after it, no thread or process outlives it;

and that a state of another pipeline is refused with a ValueError naming the stage, and
that a pipeline pickled mid-stream continues where it was.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._base import CheckpointableIterator, State

Factory = Callable[[], CheckpointableIterator[Any]]

_PLAIN_SCALARS = (str, int, float, bool, type(None))


class ContractViolation(AssertionError):
    """A checkpoint-contract rule does not hold; the message names the rule."""


def assert_checkpointable(
    factory: Factory,
    *,
    max_items: int = 60,
    restore_points: Sequence[int] | None = None,
    continuation: int = 20,
    same: Callable[[Any, Any], bool] | None = None,
    check_pickle: bool = True,
    check_torch: bool = True,
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
        for label, state in _variants(states[position], check_torch):
            fresh = factory()
            fresh.setstate(state)
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

    _check_foreign_state(factory)
    if check_pickle:
        _check_pickle(factory, reference, equal)
    _check_close(pipeline, threads_before, children_before)


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


def _restore_points(length: int, chosen: Sequence[int] | None) -> list[int]:
    if chosen is not None:
        return sorted({point for point in chosen if 0 <= point <= length})
    if length <= 64:
        return list(range(length + 1))
    step = length / 64
    return sorted({round(index * step) for index in range(64)} | {length})


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


def _check_pickle(
    factory: Factory, reference: Sequence[Any], equal: Callable[[Any, Any], bool]
) -> None:
    pipeline = factory()
    middle = len(reference) // 2
    _take(pipeline, middle)
    copied = pickle.loads(pickle.dumps(pipeline))
    got = _take(copied, len(reference) - middle)
    _require(
        _all_same(got, reference[middle:], equal),
        "pickle",
        f"a pipeline pickled at item {middle} continues with {_preview(got)}, "
        f"expected {_preview(reference[middle:])}",
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
