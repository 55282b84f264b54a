"""Stateful transforms: each output depends on the items before it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from .._core.checks import require_callable, require_checkpointable
from .._core.protocol import CheckpointableIterator, State
from .._core.stage import Stage, fast_iterator, source_state, state_before_last


class RecurrentIterator(Stage[Any]):
    """Threads a state through the items: ``state, output = step_function(state, item)``.

    Args:
        source_iterator: the source; it is reset.
        step_function: ``(state, item) -> (new_state, output)``.
        initial_state: the state before the first item (deep-copied).

    Checkpoint:
        ``{"source", "recurrent_state"}``: the source's state and a deep copy of the
        recurrent state, which must be plain data for JSON checkpoints. Nothing is re-read.
        After an error in `step_function`, the state holds the source's state one item
        back and the recurrent state as it is (a step that changes its state in place
        before raising leaves that change), so a restore re-attempts the failing item;
        over a source that cannot step back (see `MapIterator`), `getstate` raises
        RuntimeError: restore a checkpoint taken before the error.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "source": dict,
        "recurrent_state": object,
    }
    _user_callables = ("step_function",)
    _loses_input_on_error = True

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        step_function: Callable[[Any, Any], tuple[Any, Any]],
        initial_state: Any = None,
    ) -> None:
        require_checkpointable("RecurrentIterator", "source_iterator", source_iterator)
        require_callable("RecurrentIterator", "step_function", step_function)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._step = step_function
        self._initial_state = copy.deepcopy(initial_state)
        self._restore(None)

    def _state(self) -> State:
        return {
            "source": source_state(self._source),
            "recurrent_state": copy.deepcopy(self._recurrent_state),
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._recurrent_state = copy.deepcopy(
            self._initial_state if state is None else state["recurrent_state"]
        )
        self._iterator = self._generate()

    def _fields_after_lost_input(self) -> State:
        before = state_before_last(self._source)
        if before is None:
            return super()._fields_after_lost_input()
        return {**self._state(), "source": before}

    def _generate(self) -> Iterator[Any]:
        step = self._step
        for item in fast_iterator(self._source):
            self._recurrent_state, output = step(self._recurrent_state, item)
            yield output
