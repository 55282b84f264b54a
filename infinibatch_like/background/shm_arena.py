"""A ring of pickled messages in one shared-memory segment, written by one sender and
read in place by many receivers: a fan-out's owner writes each item's reply once, and
tells each consumer process where it lies instead of sending its bytes through the
consumer's socket (a copy into the kernel and one out of it, per consumer).

The sender `put`s a message's bytes into the ring (a copy into its mapping of it, whose
pages are reserved at creation) and gets a `Span` (offset, length) that is *held*: by
its message while the sender may still send it, and by each receiver it is sent to until
that receiver has read it. The sender `let_go`es each hold; the ring reuses its bytes
once every span before them is let go (oldest first). A message the ring has no room for
(or larger than a quarter of it) gets no span: the sender sends its bytes; so does a
sender for which /dev/shm has no room for the ring. A receiver maps the ring once
(`Ring.attach`), read only, and unpickles a span's bytes where they lie, before it asks
for more.

The segment is named like the sender's other segments (`shm_broadcast`), so that it is
registered with the sender's resource tracker and removed with them when the sender is
killed; the sender unlinks it at `close` (the mappings of receivers stay valid).
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from typing import Any

from . import segments

CAPACITY = 8 << 20
"""Bytes of a ring: at the usual sizes of replies (a few KiB to 64 KiB: larger arrays go
through segments of their own), room for every reply a fan-out keeps, and a small part
of the 64 MiB of /dev/shm that containers get by default."""


class Span:
    """Where a message lies in a ring, and how many hold it."""

    __slots__ = ("holds", "length", "offset", "start")

    def __init__(self, start: int, offset: int, length: int) -> None:
        self.start, self.offset, self.length = start, offset, length
        self.holds = 1


class Ring:
    """The sender's side of a ring of `capacity` bytes named `name` (see the module)."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self._segment: segments.Segment | None = segments.Segment(name, capacity)
        self._view: Any = memoryview(
            self._segment.memory.buffer(segments.HEADER, capacity)
        ).cast("B")
        self._head = 0
        """Where the next message goes, counted from the ring's start (not wrapped)."""
        self._spans: deque[Span] = deque()
        """The spans that may still be read, oldest first."""

    def put(self, data: bytes) -> Span | None:
        """Write `data` into the ring: its span (held once, by its message), or None if
        there is no room for it."""
        size = len(data)
        if size == 0 or 4 * size > self.capacity or self._segment is None:
            return None
        spans = self._spans
        while spans and spans[0].holds <= 0:
            spans.popleft()
        start = self._head
        offset = start % self.capacity
        if offset + size > self.capacity:  # no message wraps around the end
            start += self.capacity - offset
            offset = 0
        oldest = spans[0].start if spans else start
        if start + size - oldest > self.capacity:
            return None
        self._view[offset : offset + size] = data
        span = Span(start, offset, size)
        spans.append(span)
        self._head = start + size
        return span

    @staticmethod
    def hold(span: Span) -> None:
        """`span` was sent to a receiver: held until it has read it."""
        span.holds += 1

    @staticmethod
    def let_go(span: Span) -> None:
        span.holds -= 1

    def in_use(self) -> int:
        """Bytes between the oldest span still held and the next message's place."""
        live = [span for span in self._spans if span.holds > 0]
        return self._head - live[0].start if live else 0

    def close(self) -> None:
        """Unlink and unmap the ring (receivers' mappings stay valid). Idempotent."""
        if self._segment is not None:
            self._view.release()
            self._segment.memory.close()
            self._segment = None
            segments.unlink_name(self.name)
        self._spans.clear()

    def forget(self) -> None:
        """In a forked child: leave the ring to the parent (its name stays)."""
        self._segment = None

    @staticmethod
    def attach(name: str, capacity: int) -> memoryview:
        """A receiver's read-only view of ring `name`, mapped once (without keeping a
        file descriptor open), unmapped once the view and its slices are collected."""
        length = segments.HEADER + capacity
        memory = segments.mapped(name, length, os.O_RDONLY, mmap.MAP_SHARED)
        return memoryview(memory.buffer(segments.HEADER, capacity)).cast("B").toreadonly()
