"""Item functions that several tests map over: module level, so that pipelines pickle."""

from __future__ import annotations

import threading
from typing import Any


def add_one(x: int) -> int:
    return x + 1


def failing(x: int) -> int:
    """Raises KeyError("bad record") on item 3; the identity on the others."""
    if x == 3:
        raise KeyError("bad record")
    return x


def lock_at_5(x: int) -> Any:
    """Item 5's output (a lock) cannot be pickled; the others are themselves."""
    return threading.Lock() if x == 5 else x


def packed_lists(sequence: Any) -> tuple[list[Any], ...]:
    """A packed sequence's arrays as plain lists (comparable and JSON-able)."""
    return tuple(value.tolist() for value in sequence.values())
