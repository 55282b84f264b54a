"""The book of a fan-out: one upstream pipeline read once, the position of each of its
consumers, the items between the slowest and the fastest, and upstream snapshots.

Positions are upstream item indices. Consumer ``i`` has taken ``taken[i]`` items; the next
one it needs is `next_index` (item ``taken[i]`` in ``"replicate"`` mode, item
``taken[i] * consumers + i`` in ``"split"`` mode). The buffer holds the items from `base`
(the smallest index an open consumer still needs) to `head` (the next item the upstream
yields). A snapshot of the upstream's state is taken every `snapshot_every` upstream items
and kept until no open consumer needs an item before the next one, so that a state is the
latest snapshot at or before the slowest consumer plus every consumer's count.

The book is shared by threads: every method takes `lock`. The upstream is read outside
the lock by one consumer at a time (the others wait, or take buffered items meanwhile).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .._core.checks import require_int
from .._core.protocol import CheckpointableIterator, State, StateMismatchError
from .._core.stage import fast_iterator, source_state
from .lifecycle import POLL_S, check_interrupt

MODES = ("replicate", "split")

NAME = "FanOut"

PULL_AHEAD = 8
"""How many items past its own a consumer reads from the upstream at once (within the
lag window), so that the others find them ready rather than wait for a read each."""


def mismatch(reason: str) -> StateMismatchError:
    return StateMismatchError(reason, (NAME,))


class ConsumerClosed(RuntimeError):
    """Raised to a consumer of a fan-out that is closed (by itself or by the owner)."""


class Hub:
    """Positions, buffer and snapshots of a fan-out over `source` (see the module)."""

    pull: Iterator[Any]
    head: int
    base: int
    buffer: deque[Any]
    snapshots: deque[tuple[int, State]]
    end: int | None
    failure: tuple[int, BaseException] | None
    pulling: bool

    def __init__(
        self,
        source: CheckpointableIterator[Any],
        consumers: int,
        mode: str,
        max_lag: int,
        snapshot_every: int,
        timeout: float | None,
    ) -> None:
        self.source = source
        self.consumers, self.mode, self.max_lag = consumers, mode, max_lag
        self.snapshot_every, self.timeout = snapshot_every, timeout
        self.lock = threading.Condition()
        self.taken = [0] * consumers
        self.closed = [False] * consumers
        self.disconnected_since: list[float | None] = [None] * consumers
        """For consumers in other processes: when their connection was lost (None: live)."""
        self.last_taken = [time.monotonic()] * consumers
        self.last_thread: list[threading.Thread | None] = [None] * consumers
        self.lent = [0] * consumers
        """Items a remote consumer may hold unused (its last reply's): snapshots are kept
        for its position before them."""
        self.shut = False
        self.claimed: dict[int, str] = {}
        self.pulled = 0
        """Items read from the upstream in all (replays after restores included)."""
        self.on_done: Callable[[], None] = self.close_all
        """What closes the fan-out (its owner's close)."""
        self.on_change: Callable[[], None] | None = None
        """Called, holding the lock, when waiting consumers may go on (a server that
        answers remote consumers wakes up)."""
        self._reset(None, 0)

    # -- positions ---------------------------------------------------------------------

    def next_index(self, consumer: int, taken: int | None = None) -> int:
        count = self.taken[consumer] if taken is None else taken
        return count if self.mode == "replicate" else count * self.consumers + consumer

    def _ended(self, consumer: int) -> bool:
        return self.end is not None and self.next_index(consumer) >= self.end

    def _holding(self) -> list[int]:
        """The consumers that hold the others back: open and not at the end."""
        if self.end is None:
            return [i for i, closed in enumerate(self.closed) if not closed]
        return [i for i in range(self.consumers) if not self.closed[i] and not self._ended(i)]

    def _needed(self, holding: list[int] | None = None, lent: bool = False) -> int:
        """The smallest index that an open consumer (of `holding`, if given) still needs
        (`head` if none); `lent`: counting the items it may hold unused as not taken."""
        holding = self._holding() if holding is None else holding
        if not holding:
            return self.head
        taken = self.taken
        counts = [taken[i] - self.lent[i] for i in holding] if lent else [taken[i] for i in holding]
        if self.mode == "replicate":  # the index is the count: no call per consumer
            return min(counts)
        return min(self.next_index(i, count) for count, i in zip(counts, holding, strict=True))

    def _least(self, holding: list[int]) -> int | None:
        """The fewest items a consumer of `holding` has taken (None: none holds)."""
        taken = self.taken
        return min([taken[i] for i in holding]) if holding else None

    def _blocker(self, consumer: int, holding: list[int], least: int | None) -> int | None:
        """The slowest consumer of `holding` (which has taken `least` items), if
        `consumer` is `max_lag` items ahead of it."""
        taken = self.taken
        if least is None or taken[consumer] - least < self.max_lag:
            return None
        return min(holding, key=lambda i: (taken[i], i))

    # -- items -------------------------------------------------------------------------

    def take(self, consumer: int) -> Any:
        """The next item of `consumer` (see `take_at`)."""
        return self.take_at(consumer)[1]  # type: ignore[index]

    def take_at(
        self, consumer: int, cancelled: Callable[[], bool] | None = None, wait: bool = True
    ) -> tuple[int, Any] | None:
        """The upstream index and the next item of `consumer`, waiting while it is
        `max_lag` items ahead of the slowest open consumer (None then if not `wait`);
        StopIteration at the end; the upstream's error at its item. `cancelled` is asked
        while waiting (a remote consumer that went away)."""
        with self.lock:
            while True:
                if self.shut:
                    raise ConsumerClosed(f"{NAME}: the fan-out is closed")
                if self.closed[consumer]:
                    raise ConsumerClosed(f"{NAME}: consumer {consumer} is closed")
                index = self.next_index(consumer)
                if self.end is not None and index >= self.end:
                    raise StopIteration
                if self.failure is not None and index >= self.failure[0]:
                    raise self.failure[1]
                holding = self._holding()
                least = self._least(holding)
                blocker = self._blocker(consumer, holding, least)
                if blocker is None:
                    if index < self.head:
                        return index, self._hand_over(consumer, index, holding, least)
                    if not self.pulling:
                        ahead = min(index + PULL_AHEAD, self._window_end(holding))
                        self._pull_until(max(index, ahead))
                        continue
                if not wait:
                    return None
                self._wait(consumer, blocker, cancelled)

    def check_waiting(self, consumer: int) -> None:
        """For a consumer whose `take_at` (not waiting) found no item: raise if its wait
        must end (as `take_at` would while waiting for a remote consumer)."""
        with self.lock:
            holding = self._holding()
            blocker = self._blocker(consumer, holding, self._least(holding))
            if blocker is not None:
                self._check_blocker(consumer, blocker, False)

    def _notify(self) -> None:
        self.lock.notify_all()
        if self.on_change is not None:
            self.on_change()

    def _window_end(self, holding: list[int]) -> int:
        """The last index that the buffer may hold now (`max_lag` items per consumer
        after the slowest one of `holding`)."""
        width = self.max_lag * (self.consumers if self.mode == "split" else 1)
        return self._needed(holding) + width - 1

    def _hand_over(self, consumer: int, index: int, holding: list[int], least: int | None) -> Any:
        """Item `index` to `consumer`, one of `holding` (the consumers holding now, the
        slowest of which has taken `least` items)."""
        item = self.buffer[index - self.base]
        taken = self.taken
        slowest = taken[consumer] == least
        taken[consumer] += 1
        self.last_taken[consumer] = time.monotonic()
        self.last_thread[consumer] = threading.current_thread()
        if self.end is not None:  # it may have reached the end: it holds no one back
            self._trim()
        elif slowest:  # else the slowest position, and what it needs, did not move (the
            self._trim(holding)  # snapshots before lent items are trimmed at `lend`)
        if slowest:  # the others may wait for it: they may be free to go now
            self._notify()
        return item

    def _wait(
        self, consumer: int, blocker: int | None, cancelled: Callable[[], bool] | None
    ) -> None:
        if blocker is not None:
            self._check_blocker(consumer, blocker, cancelled is None)
        self.lock.wait(POLL_S)
        check_interrupt()
        if cancelled is not None and cancelled():
            raise ConsumerClosed(f"{NAME}: consumer {consumer} went away")

    def _check_blocker(self, consumer: int, blocker: int, local: bool) -> None:
        """Raise rather than wait for a consumer that cannot or does not move."""
        ahead = (
            f"{NAME}: consumer {consumer} is max_lag={self.max_lag} items ahead of "
            f"consumer {blocker}"
        )
        gone = self.disconnected_since[blocker]
        if local and self.last_thread[blocker] is threading.current_thread():
            raise RuntimeError(
                f"{ahead}, which was last read by this same thread: waiting for it would "
                "never end. Read the consumers from separate threads, or close() the "
                "consumers you stop reading (a closed consumer holds no one back)"
            )
        if self.timeout is None:
            return
        now = time.monotonic()
        if gone is not None and now - gone > self.timeout:
            raise RuntimeError(
                f"{ahead}, whose process disconnected {now - gone:.0f} s ago and has not "
                f"attached again within timeout={self.timeout} s (did it die?); restart it "
                "from a checkpoint, or close it from the owner with close_consumer()"
            )
        if (
            gone is None
            and now - max(self.last_taken[blocker], self.last_taken[consumer]) > self.timeout
        ):
            raise RuntimeError(
                f"{ahead}, which has taken no item for timeout={self.timeout} s; close() "
                "the consumers you stop reading (a closed consumer holds no one back)"
            )

    def _pull_until(self, index: int) -> None:
        """Read the upstream up to item `index`, outside the lock (held on entry and exit)."""
        self.pulling = True
        start, pull, every, source = self.head, self.pull, self.snapshot_every, self.source
        items: list[Any] = []
        snapshots: list[tuple[int, State]] = []
        outcome: tuple[str, BaseException | None] = ("", None)
        self.lock.release()
        try:
            while start + len(items) <= index:
                items.append(next(pull))
                if (start + len(items)) % every == 0:
                    snapshots.append((start + len(items), source_state(source)))
        except StopIteration:
            outcome = ("end", None)
            snapshots.append((start + len(items), source_state(source)))
        except BaseException as error:  # the consumers reaching this item raise it
            outcome = ("failure", error)
        finally:
            self.lock.acquire()
            self.pulling = False
            self._notify()
        self.pulled += len(items)
        self.buffer.extend(items)
        self.head += len(items)
        self.snapshots.extend(snapshots)
        if outcome[0] == "end":
            self.end = self.head
        elif outcome[1] is not None:
            self.failure = (self.head, outcome[1])
        self._trim()

    def _trim(self, holding: list[int] | None = None) -> None:
        """Drop the items and snapshots that no open consumer (of `holding`, if given: the
        consumers holding now) needs any more."""
        holding = self._holding() if holding is None else holding
        needed = self._needed(holding)
        buffer = self.buffer
        while self.base < needed and buffer:
            buffer.popleft()
            self.base += 1
        snapshots = self.snapshots
        if len(snapshots) < 2 or snapshots[1][0] > needed:
            return  # the next snapshot is needed (counting lent items can only lower it)
        if any(self.lent):  # a remote consumer may not have used what it was sent
            needed = self._needed(holding, lent=True) if holding else needed
        while len(snapshots) > 1 and snapshots[1][0] <= needed:
            snapshots.popleft()

    # -- states ------------------------------------------------------------------------

    def state(self, consumer: int = 0, held: int = 0) -> State:
        """The fields of the fan-out's state (see `FanOut`), `consumer` counted without
        the `held` items it was sent and has not used."""
        with self.lock:
            index, snapshot = self.snapshots[0]
            taken = list(self.taken)
            taken[consumer] -= held
            return {
                "source": snapshot,
                "source_index": index,
                "taken": taken,
                "closed": list(self.closed),
            }

    def lend(self, consumer: int, count: int) -> None:
        """`consumer` was sent `count` items at once (it may hold them unused)."""
        with self.lock:
            self.lent[consumer] = count
            self._trim()

    def _reset(self, state: State | None, index: int) -> None:
        """Set the upstream to `state` (None: its start), at upstream item `index`."""
        try:
            self.source.setstate(state)
        except StateMismatchError as error:
            raise error.within(f"{NAME}.source") from None
        self.pull = fast_iterator(self.source)
        self.head = self.base = index
        self.buffer = deque()
        self.snapshots = deque([(index, source_state(self.source))])
        self.end = None
        self.failure = None
        self.pulling = False

    @staticmethod
    def _positions(state: State) -> tuple[int, list[int], list[bool]]:
        """A state's positions (checked by the consumer's schema, `stages.fanout`)."""
        return state["source_index"], list(state["taken"]), list(state["closed"])

    def _check_replay(self, index: int, taken: list[int], closed: list[bool]) -> None:
        """Refuse positions before the snapshot, or a replay longer than any state holds."""
        open_ = [i for i in range(self.consumers) if not closed[i]]
        for i in open_:
            if self.next_index(i, taken[i]) < index:
                raise mismatch(
                    f"consumer {i} is at item {self.next_index(i, taken[i])}, before the "
                    f"upstream snapshot of the state (item {index}): its items cannot be "
                    "derived again from it"
                )
        slowest = min((self.next_index(i, taken[i]) for i in open_), default=index)
        # A state holds at most snapshot_every + consumers; a consumer restored alone may
        # be up to its lag ahead of the slowest consumer of its state.
        bound = self.snapshot_every + (self.max_lag + 1) * self.consumers
        if slowest - index > bound:
            raise mismatch(
                f"the slowest consumer is {slowest - index} items after the upstream "
                f"snapshot, more than snapshot_every + (max_lag + 1) * consumers = {bound}; "
                "if the state came from a fan-out built with a larger snapshot_every or "
                "max_lag, build this one with them too"
            )

    def restore_all(self, state: State | None) -> None:
        """Every consumer to its position in `state` (None: the start); consumers closed
        in `state` are closed."""
        with self.lock:
            self._quiesce()
            if state is None:
                self._reset(None, 0)
                self.taken = [0] * self.consumers
                self.closed = [False] * self.consumers
            else:
                index, taken, closed = self._positions(state)
                self._check_replay(index, taken, closed)
                self._reset(state["source"], index)
                self.taken, self.closed = taken, closed
            self.lent = [0] * self.consumers
            self.last_taken = [time.monotonic()] * self.consumers
            self.last_thread = [None] * self.consumers
            self._notify()

    def restore_one(self, consumer: int, state: State | None) -> None:
        """Consumer `consumer` (reopened if it was closed) to its position in `state`
        (None: its start), the others left where they are. The upstream stays where it is
        if the consumer's items can be taken from it; else it is set to the state's
        snapshot (None: its start), which must come at or before every open consumer."""
        with self.lock:
            self._quiesce()
            if state is None:
                index, own, snapshot = 0, 0, None
            else:
                index, taken, _ = self._positions(state)
                own, snapshot = taken[consumer], state["source"]
            positions = list(self.taken)
            positions[consumer] = own
            closed = list(self.closed)
            closed[consumer] = False
            keep = self.next_index(consumer, own) >= self.base and self.failure is None
            if keep and not (index > self.head and self._fits(index, positions, closed)):
                self._check_replay(self.snapshots[0][0], positions, closed)
            else:
                self._check_replay(index, positions, closed)
                self._reset(snapshot, index)
            self.taken, self.closed = positions, closed
            self.lent[consumer] = 0
            self.last_taken[consumer] = time.monotonic()
            self._trim()
            self._notify()

    def _fits(self, index: int, taken: list[int], closed: list[bool]) -> bool:
        try:
            self._check_replay(index, taken, closed)
        except StateMismatchError:
            return False
        return True

    def _quiesce(self) -> None:
        """Wait (holding the lock) until no consumer is reading the upstream."""
        while self.pulling:
            self.lock.wait(POLL_S)

    # -- who reads which consumer ------------------------------------------------------

    def claim(self, index: int, by: str) -> None:
        """Reserve consumer `index` for `by` (this process, or a connection)."""
        require_int(NAME, "index", index, 0)
        if index >= self.consumers:
            raise ValueError(
                f"{NAME}: consumer index must be < consumers={self.consumers}, got {index}"
            )
        with self.lock:
            if index in self.claimed:
                raise ValueError(
                    f"{NAME}: consumer {index} is already taken ({self.claimed[index]})"
                )
            self.claimed[index] = by

    def release(self, index: int) -> None:
        """Free consumer `index` for another `claim` (its process went away)."""
        with self.lock:
            self.claimed.pop(index, None)

    # -- closing -----------------------------------------------------------------------

    def close_consumer(self, consumer: int) -> None:
        """Mark `consumer` closed: it holds no one back from now on."""
        with self.lock:
            self.closed[consumer] = True
            self._trim()
            self._notify()

    def connected(self, consumer: int, live: bool) -> None:
        """A remote consumer attached (`live`) or lost its connection."""
        with self.lock:
            self.disconnected_since[consumer] = None if live else time.monotonic()
            self.last_taken[consumer] = time.monotonic()
            self._notify()

    def close_if_done(self) -> None:
        """Close the fan-out (`on_done`) once every consumer is closed."""
        if all(self.closed):
            self.on_done()

    def close_all(self) -> None:
        """Close every consumer and the upstream (idempotent)."""
        with self.lock:
            if self.shut:
                return
            self._quiesce()
            self.shut = True
            self.buffer.clear()
            self._notify()
        self.source.close()
