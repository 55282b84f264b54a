"""Stages that read a group of items at a time and yield it rearranged by a seeded generator.

Block-wise shuffling and bucketed batching both work this way. Their state is where the
current group starts (the source's state and the generator's position) and how many of
its outputs were yielded: no items, at the price of re-reading one group on restore.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Iterator
from functools import partial
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_checkpointable
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import (
    MARK_FIELDS,
    CountingRandom,
    Mark,
    Seed,
    adopt_seed,
    mark_fields,
    read_mark,
    resolve_seed,
)
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage, copy_plain, fast_iterator, source_state

T = TypeVar("T")


class ReadAheadStage(Stage[T]):
    """Base of stages that yield the rearranged outputs of one group of source items at a
    time; subclasses implement `_next_group`, and call `_init_read_ahead` then
    ``self._restore(None)`` in their ``__init__``.

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "emitted"}``: the source's state and the
        generator's position where the current group starts, and how many of its outputs
        were yielded (at most `_most_outputs`). Between groups the state points at the
        next group, so a restore re-reads at most the one group being yielded.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "seed": (int, str),
        **MARK_FIELDS,
        "emitted": Int(0, lambda stage: stage._most_outputs),
    }

    def _init_read_ahead(self, source: CheckpointableIterator[Any], seed: Seed | None) -> None:
        """Read groups from `source` with `seed` (fields only: see `Stage`)."""
        require_checkpointable(self._name, "source_iterator", source)
        self._seed, self._seed_drawn = resolve_seed(self._name, seed)
        self._source = source
        self._sources = (source,)

    @property
    @abstractmethod
    def _most_outputs(self) -> int:
        """The most outputs a group can have (bounds a state's 'emitted')."""

    @abstractmethod
    def _next_group(self, pull: Iterator[Any], rng: CountingRandom) -> tuple[list[T], bool]:
        """Read the next group from `pull`: its outputs, and whether it is the last one."""

    def _state(self) -> State:
        emitted = self._skip
        if not emitted and self._group_length:
            emitted = self._group_length - operator.length_hint(self._group)
            if emitted == self._group_length:  # used up: point at the next group instead
                return self._pointer(source_state(self._source), self._rng.mark(), 0)
        return self._pointer(self._anchor, self._mark, emitted)

    def _state_before_last(self) -> State | None:
        emitted = self._group_length - operator.length_hint(self._group)
        if self._skip or not self._group_length or emitted < 1:
            return None
        state = self.getstate()  # a used-up group points at the next one: step back into it
        state.update(copy_plain(self._pointer(self._anchor, self._mark, emitted - 1)))
        return state

    def _pointer(self, source: State, mark: Mark, emitted: int) -> State:
        return {"source": source, "seed": self._seed, **mark_fields(mark), "emitted": emitted}

    def _restore(self, state: State | None) -> None:
        if state is None:
            self.restore_source(self._source, None)
            self._mark: Mark = (0, None)
            self._skip = 0
        else:
            self.restore_source(self._source, state["source"])
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            self._mark = read_mark(self, state["draws"], state["generator"])
            self._skip = state["emitted"]
        self._anchor = source_state(self._source)
        self._rng = CountingRandom.from_mark(self._seed, self._mark)
        self._group: Iterator[T] = iter(())
        self._group_length = 0
        self._iterator = self._generate()

    def _generate(self) -> Iterator[T]:
        source, rng, probe = self._source, self._rng, self._probe
        pull = fast_iterator(source)
        while True:
            if probe is None:
                outputs, last = self._next_group(pull, rng)
            else:  # statistics on: a group's reading and rearranging, timed in full
                outputs, last = probe.timed(partial(self._next_group, pull, rng))
            if len(outputs) < self._skip:
                raise self.mismatch(
                    f"the checkpoint skips {self._skip} outputs of a group, "
                    f"but it has {len(outputs)}"
                )
            group = iter(outputs)
            group.__setstate__(self._skip)  # type: ignore[attr-defined]
            self._group, self._group_length, self._skip = group, len(outputs), 0
            yield from group
            if last:
                return
            self._anchor, self._mark = source_state(source), rng.mark()
            self._group, self._group_length = iter(()), 0
