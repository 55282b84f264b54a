"""The messages between background workers and their consumer, one type per kind."""

from __future__ import annotations

from typing import Any, NamedTuple

from .._core.protocol import State
from .errors import ErrorReport


class Mark(NamedTuple):
    """The source's state right after the first `offset` items of a batch."""

    offset: int
    state: State


class Batch(NamedTuple):
    """Items of the source, in order, and at most one snapshot among them."""

    items: list[Any]
    mark: Mark | None
    stats: Any = None
    """A worker process's statistics counters (`_core.probe.Delta`), now and then."""
    reads: dict[str, int] | None = None
    """With `stats`: what the worker read from object stores since its previous report."""


class End(NamedTuple):
    """The source ended; its final state."""

    state: State
    stats: Any = None
    """The worker process's last statistics counters, if statistics are on."""
    reads: dict[str, int] | None = None
    """With `stats`: what the worker read from object stores since its previous report."""


class Failure(NamedTuple):
    """The source raised: the exception (from a thread) or its report (from a process)."""

    error: BaseException | ErrorReport


Message = Batch | End | Failure


class Task(NamedTuple):
    """Items for a map worker; results come back under the same `number`."""

    number: int
    items: list[Any]
    timed: bool = False
    """Whether the worker measures its compute time (statistics are on)."""
    first: int = 0
    """The source position of the first item (counted as `ReplayCursor` counts)."""


class Result(NamedTuple):
    """A map worker's outputs for task `number`: one per item up to the first failure."""

    number: int
    outputs: list[Any]
    failure: BaseException | ErrorReport | None
    busy_s: float = 0.0
    """The worker's compute time for the task, if the task was `timed`."""
