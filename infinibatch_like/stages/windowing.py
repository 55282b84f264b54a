"""Sliding windows over consecutive items."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice
from typing import ClassVar, TypeVar

from .._core.checks import require_checkpointable, require_int
from .._core.protocol import CheckpointableIterator, State
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage, fast_iterator, source_state

T = TypeVar("T")


class WindowedIterator(Stage[tuple[T, ...]]):
    """Yields overlapping tuples of `width` consecutive items: (a, b, c), (b, c, d), ...

    Nothing is yielded if the source has fewer than `width` items.

    Checkpoint:
        ``{"source", "replay", "fingerprint"}``: the source's state at an anchor point and
        how many items to read from there to rebuild the window, and `width`, which cannot
        change at a restart. Anchors are taken every ``max(width, 64)`` items, so a
        restore re-reads fewer than twice that many items (a larger 'replay' is refused)
        and the state holds no items.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "replay": Int(0, below=lambda stage: 2 * stage._anchor_every),
    }

    def __init__(self, source_iterator: CheckpointableIterator[T], width: int) -> None:
        require_checkpointable("WindowedIterator", "source_iterator", source_iterator)
        self._width = require_int("WindowedIterator", "width", width, 1)
        self._anchor_every = max(width, 64)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._restore(None)

    def _arguments(self) -> State:
        return {"width": self._width}

    def _state(self) -> State:
        # The window holds the last width - 1 items read, so an anchor serves if it lies at
        # or before position p - (width - 1) (or at the start of this frame).
        read, latest_at = self._read, self._latest[0]
        if latest_at == 0 or latest_at <= read - (self._width - 1):
            return {"source": self._latest[1], "replay": read - latest_at}
        return {"source": self._previous[1], "replay": read - self._previous[0]}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        anchor = source_state(self._source)
        replay = 0 if state is None else state["replay"]
        # Positions count items read since the anchor this state was restored from.
        self._latest = self._previous = (0, anchor)
        self._read = replay
        self._iterator = self._generate(replay)

    def _generate(self, replay: int) -> Iterator[tuple[T, ...]]:
        width, every, source = self._width, self._anchor_every, self._source
        pull = fast_iterator(source)
        # The window needs only the last width - 1 items replayed: anchor where they start,
        # so that states taken from here on replay fewer than every + width items.
        settled = max(0, replay - (width - 1))
        replayed = list(islice(pull, settled))
        if settled and len(replayed) == settled:
            self._previous, self._latest = self._latest, (settled, source_state(source))
        replayed += islice(pull, replay - settled)
        if len(replayed) < replay:
            raise self.mismatch(
                f"the checkpoint replays {replay} items, but the source has {len(replayed)}"
            )
        window: deque[T] = deque(replayed, maxlen=width)
        next_anchor = settled + every
        for item in pull:
            window.append(item)
            self._read += 1
            if self._read == next_anchor:
                self._previous, self._latest = self._latest, (self._read, source_state(source))
                next_anchor += every
            if len(window) == width:
                yield tuple(window)
