"""Damaged states and the check that each is refused or restored in bounded time (C11).

Each number of a state is damaged in turn: an int becomes 10**18, 2**64 or -1 (counts no
state can hold), and any number becomes "7", 1.5, True or None (wrong types). Values under
the keys of the user's data (items held, recurrent states) are left as they are: they are
handed to user code, which the contract does not cover.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

from .._core.protocol import CheckpointableIterator, State
from .states import stage_names
from .streams import Factory, take
from .violations import require

HUGE_COUNTS = (10**18, 2**64, -1)
WRONG_TYPES: tuple[Any, ...] = ("7", 1.5, True, None)


def damaged(state: Any, user_data_keys: Collection[str]) -> Iterator[tuple[str, Any]]:
    """(description, damaged copy of `state`) for each number in it and each damage."""
    for path, value in _numbers(state, (), user_data_keys):
        replacements = (*HUGE_COUNTS, *WRONG_TYPES) if type(value) is int else WRONG_TYPES
        for replacement in replacements:
            if type(replacement) is type(value) and replacement == value:
                continue
            copied = copy.deepcopy(state)
            container = copied
            for key in path[:-1]:
                container = container[key]
            container[path[-1]] = replacement
            where = "".join(f"[{key!r}]" for key in path)
            yield f"state{where} = {replacement!r}", copied


def _numbers(
    value: Any, path: tuple[Any, ...], user_data_keys: Collection[str]
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


def check_damaged_states(
    factory: Factory, state: State, deadline: float, user_data_keys: Collection[str]
) -> None:
    """Restore each damaged form of `state` into a fresh pipeline and take 3 items: each
    must finish within `deadline` seconds, and fail (if it does) with a ValueError or a
    TypeError naming a stage; else a C11 `ContractViolation`."""
    names = stage_names(state)
    for description, copied in damaged(state, user_data_keys):
        pipeline = factory()
        names.add(type(pipeline).__name__)
        finished, error = _within(deadline, _restore_and_take, pipeline, copied)
        require(
            finished,
            "C11",
            f"restoring a damaged state ({description}) and taking 3 items did not finish "
            f"within {deadline} s",
        )
        pipeline.close()
        if error is None:
            continue
        require(
            isinstance(error, (ValueError, TypeError)),
            "C11",
            f"a damaged state ({description}) raised {type(error).__name__}: {error}; expected "
            "a ValueError (e.g. StateMismatchError) or TypeError naming the stage",
        )
        require(
            any(name in str(error) for name in names),
            "C11",
            f"the error for a damaged state ({description}) names no stage: {error}",
        )


def _restore_and_take(pipeline: CheckpointableIterator[Any], state: Any) -> None:
    pipeline.setstate(state)
    take(pipeline, 3)


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
