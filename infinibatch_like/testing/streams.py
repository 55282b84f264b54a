"""What both checkers do with streams and states: take items, compare and preview them,
choose restore points, and send states on their round trips (JSON, torch)."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from .._core.protocol import CheckpointableIterator, State

Factory = Callable[[], CheckpointableIterator[Any]]
"""Builds a fresh pipeline (fresh sources too), deterministically, at each call."""

Same = Callable[[Any, Any], bool]
"""Item equality."""


def default_same(a: Any, b: Any) -> bool:
    """``==`` and the same type (so that 1 and 1.0, or True and 1, differ)."""
    return bool(a == b) and type(a) is type(b)


def all_same(got: Sequence[Any], expected: Sequence[Any], equal: Same) -> bool:
    return len(got) == len(expected) and all(map(equal, got, expected))


def take(iterator: CheckpointableIterator[Any], count: int) -> list[Any]:
    """Up to `count` items of `iterator` (fewer where it ends)."""
    return list(itertools.islice(iterator, count))


def preview(items: Sequence[Any]) -> str:
    """The first items of `items`, and their count where there are more, for messages."""
    text = repr(list(items[:6]))
    return text if len(items) <= 6 else f"{text[:-1]}, ... ({len(items)} items)]"


def choose_points(length: int, chosen: Sequence[int] | None, spread: int = 64) -> list[int]:
    """The chosen points within the stream, or `spread` points evenly spread and the end."""
    if chosen is not None:
        return sorted({point for point in chosen if 0 <= point <= length})
    if length <= spread:
        return list(range(length + 1))
    step = length / spread
    return sorted({round(index * step) for index in range(spread)} | {length})


def round_trips(state: State, check_torch: bool) -> list[tuple[str, State]]:
    """(label, copy) of `state` as it is, after JSON and (if torch is installed and
    `check_torch`) after ``torch.save``/``torch.load(weights_only=True)``."""
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
