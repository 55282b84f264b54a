"""`Trial`: what the rules of one `assert_checkpointable` call look at.

A trial runs the pipelines that several rules share once: the reference stream, a run that
takes a state before every item, and the restores of those states into fresh pipelines
(each state as it is, after its round trips, and with keys a caller added). The rules
(`infinibatch_like.testing.rules`) then check what was observed, or build pipelines of
their own with `factory`.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .._core.protocol import CheckpointableIterator, State
from .states import dumped, with_caller_keys
from .streams import Factory, Same, choose_points, round_trips, take


@dataclass(frozen=True)
class Options:
    """The options of `assert_checkpointable` that the rules read (see its docstring)."""

    max_items: int
    restore_points: Sequence[int] | None
    continuation: int
    equal: Same
    check_pickle: bool
    check_torch: bool
    different: Factory | None
    check_damage: bool
    deadline: float
    user_data_keys: Collection[str]


@dataclass(frozen=True)
class Restore:
    """A fresh pipeline restored from the state taken at item `position`, as `label`
    says (``"original"``, ``"JSON round-tripped"``, ``"caller-extended"``, ...)."""

    position: int
    label: str
    refused: ValueError | None
    """What ``setstate`` raised (then nothing else was observed)."""
    state_after: str
    """Its ``getstate()`` right after the restore (as `dumped` text)."""
    items: list[Any]
    expected: list[Any]
    """The reference's items from `position` on, as many as `items` should be."""
    beyond_end: list[Any] | None
    """What ``next()`` yielded past the end of an ended stream, where the restore reached
    it (None where it did not)."""


class Trial:
    """The shared runs of the pipelines built by `factory` (see the module docstring).

    Attributes:
        reference: the items of one uninterrupted run (up to ``max_items``).
        ended: whether the stream ended before ``max_items``.
        middle: the middle of the reference, where several rules interrupt a run.
        pipeline: the run that took a state before every item; rules C2 and C3 restore
            it again, rule C8 closes it.
        states: the state it returned before each item (and after the last), as returned.
        frozen: each of those states as `dumped` text, taken when it was returned.
        items: the items that run yielded between the states.
        beyond_end: what its ``next()`` yielded after the end, where the stream ended.
        points: the positions whose states are restored into fresh pipelines.
    """

    def __init__(self, factory: Factory, options: Options) -> None:
        self.factory, self.options = factory, options
        self.threads_before = set(threading.enumerate())
        self.children_before = set(multiprocessing.active_children())
        self.reference = take(factory(), options.max_items)
        self.ended = len(self.reference) < options.max_items
        self.middle = len(self.reference) // 2
        self.pipeline = factory()
        self.states: list[State] = []
        self.frozen: list[str] = []
        self.items: list[Any] = []
        for position in range(len(self.reference) + 1):
            state = self.pipeline.getstate()
            self.states.append(state)
            self.frozen.append(dumped(state))
            if position < len(self.reference):
                item = take(self.pipeline, 1)
                if not item:  # ended early: rule C1 reports it
                    break
                self.items += item
        self.beyond_end = beyond_end(self.pipeline) if self.ended else []
        self.points = choose_points(len(self.reference), options.restore_points)

    @cached_property
    def restores(self) -> list[Restore]:
        """Each restore point's state, in each of its forms, restored into a fresh
        pipeline: its first `continuation` items (all the rest at the first, middle and
        last points, which also get the caller-extended form)."""
        points = self.points
        long_points = {points[0], points[len(points) // 2], points[-1]}
        restores = []
        for position in points:
            remaining = len(self.reference) - position
            length = (
                remaining if position in long_points else min(self.options.continuation, remaining)
            )
            expected = self.reference[position : position + length]
            forms = round_trips(self.states[position], self.options.check_torch)
            if position in long_points:
                extended = {
                    **with_caller_keys(self.states[position]),
                    "epoch": 3,
                    "iterations_in_epoch": 7,
                }
                forms.append(("caller-extended", extended))
            reaches_end = self.ended and position + length == len(self.reference)
            for label, state in forms:
                restores.append(
                    self._restore(position, label, state, expected, length, reaches_end)
                )
        return restores

    def _restore(
        self,
        position: int,
        label: str,
        state: State,
        expected: list[Any],
        length: int,
        reaches_end: bool,
    ) -> Restore:
        fresh = self.factory()
        try:
            fresh.setstate(state)
        except ValueError as error:
            fresh.close()
            return Restore(position, label, error, "", [], expected, None)
        state_after = dumped(fresh.getstate())
        items = take(fresh, length)
        after = beyond_end(fresh) if reaches_end else None
        fresh.close()
        return Restore(position, label, None, state_after, items, expected, after)


def beyond_end(iterator: CheckpointableIterator[Any]) -> list[Any]:
    """What two more ``next(iterator)`` calls yield after its end (nothing, if sticky)."""
    found = []
    for _ in range(2):
        try:
            found.append(next(iterator))
        except StopIteration:
            continue
    return found
