"""Checks of the arguments stages are built with, each error naming the stage and the
argument."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .names import callable_name
from .protocol import CheckpointableIterator


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


def batch_outputs(
    owner: str, transform: Callable[[list[Any]], Sequence[Any]], items: list[Any]
) -> list[Any]:
    """``transform(items)`` as a list, which must hold one output per item."""
    outputs = list(transform(items))
    if len(outputs) != len(items):
        raise ValueError(
            f"{owner}: its batched transform {callable_name(transform)} returned "
            f"{len(outputs)} outputs for {len(items)} items; it must return one per item, "
            "in order"
        )
    return outputs
