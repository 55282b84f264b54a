"""The consumer's position in a background stage's source: a snapshot of the source's
state and how many items were consumed since; the checkpoint of every background stage."""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator
from typing import Any

from .._core.protocol import State
from .messages import Mark


class ReplayCursor:
    """Where the consumer is: the latest snapshot at or before its position, and the
    number of items consumed since that snapshot (the `replay` of a checkpoint).

    Positions count source items from the snapshot the stage was restored from (whose
    own position is `replay` items before the restore point). Snapshots taken ahead of
    the consumer (by a worker, or while dispatching) are kept until the consumer passes
    them. Items reach the consumer in batches (`serve`), counted as it takes them.
    """

    def __init__(self, snapshot: State, replay: int) -> None:
        self._snapshots: deque[tuple[int, State]] = deque([(0, snapshot)])
        self.consumed = replay
        """Items consumed before the current batch."""
        self._batch: Iterator[Any] = iter(())
        self._batch_length = 0

    def snapshot(self, position: int, state: State) -> None:
        """Record the source's `state` at `position` (at or after every earlier one)."""
        self._snapshots.append((position, state))

    def serve(self, items: list[Any], mark: Mark | None = None) -> Iterator[Any]:
        """The iterator over `items` that the consumer takes them from (after the previous
        batch was `served`); `mark` is a snapshot among them."""
        if mark is not None:
            self.snapshot(self.consumed + mark.offset, mark.state)
        self._batch = batch = iter(items)
        self._batch_length = len(items)
        return batch

    def served(self) -> None:
        """The consumer took every item of the current batch."""
        self.consumed += self._batch_length
        self._batch_length = 0
        snapshots = self._snapshots
        while len(snapshots) > 1 and snapshots[1][0] <= self.consumed:
            snapshots.popleft()

    def position(self) -> int:
        """Items consumed, the current batch's included."""
        return self.consumed + self._batch_length - operator.length_hint(self._batch)

    def unserved(self) -> int:
        """Items of the current batch that the consumer has not taken yet."""
        return operator.length_hint(self._batch)

    def state(self) -> State:
        """``{"source": snapshot, "replay": items consumed since}``."""
        consumed = self.position()
        position, snapshot = self._snapshots[0]
        for later, later_snapshot in self._snapshots:
            if later > consumed:
                break
            position, snapshot = later, later_snapshot
        return {"source": snapshot, "replay": consumed - position}
