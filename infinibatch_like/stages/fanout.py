"""Fan-out: one upstream pipeline read once by several consumers (threads of this process,
or processes of this host that `attach` by address), each item to every consumer
(``"replicate"``) or to exactly one (``"split"``), with one checkpoint for them all."""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, Generic, TypeVar

from .._core.checks import require_checkpointable, require_int
from .._core.protocol import CheckpointableIterator, State, StateMismatchError
from .._core.schema import FieldSpec, Int, ListOf
from .._core.stage import Stage, _Halted
from ..background.fanout_hub import MODES, NAME, Hub

T = TypeVar("T")


class FanOutStage(Stage[T], Generic[T]):
    """What the owner and the consumers of a fan-out share: the state's tag (``"FanOut"``),
    its fields and its fingerprint (the mode and the number of consumers)."""

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "source_index": Int(0),
        "taken": ListOf(Int(0), lambda stage: stage._count, "consumer"),
        "closed": ListOf(bool, lambda stage: stage._count, "consumer"),
    }
    _mode: str
    _count: int

    @property
    def _name(self) -> str:
        return NAME

    def _arguments(self) -> State:
        return {"mode": self._mode, "consumers": self._count}

    def mismatch(self, reason: str) -> StateMismatchError:
        return StateMismatchError(reason, (f"{NAME} ({type(self).__name__})",))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        raise pickle.PicklingError(
            f"cannot pickle a {NAME} consumer: it reads a fan-out shared with others; in "
            "another process, attach to the fan-out by its address (FanOut.serve, attach)"
        )


class _Book(FanOutStage[Any]):
    """The owner's view of the fan-out's state (not iterated)."""

    def __init__(self, hub: Hub) -> None:
        self._hub, self._mode, self._count = hub, hub.mode, hub.consumers
        self._iterator = _Halted(f"{NAME}: iterate its consumers, not the fan-out", None)

    def _state(self) -> State:
        return self._hub.state()

    def _restore(self, state: State | None) -> None:
        self._hub.restore_all(state)


class _Taking(Iterator[Any]):
    """The items of one consumer, taken from the hub."""

    def __init__(self, hub: Hub, index: int) -> None:
        self._take, self._index = hub.take, index

    def __next__(self) -> Any:
        return self._take(self._index)


class FanOutConsumer(FanOutStage[T], Generic[T]):
    """One consumer of a `FanOut` in this process (made by `FanOut.consumer`).

    Checkpoint:
        The whole fan-out's state (see `FanOut`), the same from every consumer and from
        the owner. ``setstate(state)`` moves this consumer alone to its position in
        `state` (the others go on): see `FanOut`. ``setstate(None)`` moves it back to the
        start of the stream.
    """

    def __init__(self, owner: FanOut[T], index: int) -> None:
        hub = self._hub = owner._hub
        self._index, self._mode, self._count = index, hub.mode, hub.consumers
        self._iterator = self._items()

    def _items(self) -> Iterator[T]:
        return _Taking(self._hub, self._index)

    def _state(self) -> State:
        return self._hub.state()

    def _restore(self, state: State | None) -> None:
        self._hub.restore_one(self._index, state)
        self._iterator = self._items()

    def close(self) -> None:
        """Close this consumer: from now on it holds no other consumer back. Closing the
        last open consumer closes the fan-out and its upstream."""
        closing = not self._closed
        super().close()  # records the position, from which a restore continues
        if closing:
            self._hub.close_consumer(self._index)
            self._hub.close_if_done()


class FanOut(Generic[T]):
    """One upstream pipeline, read once, for several consumers.

    ``fan = FanOut(pipeline, 3)`` makes three consumers of `pipeline`'s items:
    ``fan.consumer(i)`` in this process (each read by its own thread), or, after
    ``fan.serve(path)``, ``attach(path, i)`` in other processes of this host (started by
    any means and any start method). In ``"replicate"`` mode every consumer yields every
    item, in the same order; in ``"split"`` mode item ``k`` goes to consumer
    ``k % consumers`` only (a fixed assignment, the same after every restore). Either
    way the upstream runs once: each item is read and transformed once, whatever the
    number of consumers.

    A consumer waits while it is `max_lag` items ahead of the slowest open consumer, so
    at most about ``max_lag`` items (``max_lag * consumers`` in split mode) are held.
    A consumer that stops early must be closed: a closed consumer holds no one back (its
    items are no longer kept). Rather than wait forever, a consumer raises RuntimeError,
    naming the consumer it waits for, when that one was last read by the same thread (it
    cannot move), or has not moved, or its process stayed disconnected, for `timeout`
    seconds.

    Args:
        source: the upstream pipeline; it is reset, and the fan-out owns it (closing the
            fan-out closes it).
        consumers: how many consumers (>= 1).
        mode: ``"replicate"`` or ``"split"``.
        max_lag: how many items a consumer may be ahead of the slowest one (>= 1); may
            change at a restart.
        snapshot_every: the upstream's state is recorded every `snapshot_every` items
            (>= 1): a restore replays at most that many plus `consumers`.
        timeout: seconds a consumer waits for a blocking consumer that does not move,
            or for a disconnected consumer process to attach again, before it raises
            (None: forever).

    Raises:
        ValueError: for a bad number, mode or source.

    Checkpoint:
        One state for the whole fan-out, from ``fan.getstate()`` or any consumer's
        ``getstate()``: ``{"source", "source_index", "taken", "closed"}``: the upstream's
        state at the latest snapshot at or before the slowest open consumer, its upstream
        item index, how many items each consumer has taken, and which consumers are
        closed; plus the fingerprint (mode, consumers). Size: one upstream state and two
        lists of `consumers` entries. ``fan.setstate(state)`` restores every consumer
        (closed ones stay closed); a consumer's ``setstate(state)`` moves only that
        consumer (reopened if it was closed): the one restarted after its process was
        killed, while the others go on. In both, the items from the snapshot to each
        consumer's position are derived again from the upstream, once for all consumers:
        at most `snapshot_every` + `consumers` items before the slowest consumer. A
        consumer restored behind the others rewinds the upstream to the state's snapshot
        if its items are gone; the others then wait until it is back within `max_lag`.
        A state whose replay is longer than ``snapshot_every + (max_lag + 1) *
        consumers`` is refused (e.g. damaged, or from a fan-out built with larger
        values). Positions of consumers in other processes are those they had reached when the
        state was taken: for a state that every consumer resumes from exactly, take it
        where they are in step (or have each save its own).
    """

    def __init__(
        self,
        source: CheckpointableIterator[T],
        consumers: int,
        *,
        mode: str = "replicate",
        max_lag: int = 16,
        snapshot_every: int = 100,
        timeout: float | None = 300.0,
    ) -> None:
        require_checkpointable(NAME, "source", source)
        require_int(NAME, "consumers", consumers, 1)
        require_int(NAME, "max_lag", max_lag, 1)
        require_int(NAME, "snapshot_every", snapshot_every, 1)
        if mode not in MODES:
            raise ValueError(f"{NAME}: mode must be one of {MODES}, got {mode!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValueError(f"{NAME}: timeout must be a number > 0 or None, got {timeout!r}")
        self._hub = Hub(source, consumers, mode, max_lag, snapshot_every, timeout)
        self._book = _Book(self._hub)
        self._server: list[Any] = [None]
        self._finalizer = weakref.finalize(self, _stop, self._hub, self._server)
        self._hub.on_done = self._finalizer

    @property
    def consumers(self) -> int:
        """The number of consumers."""
        return self._hub.consumers

    @property
    def closed(self) -> bool:
        """Whether the fan-out is closed (by `close`, or by the close of its last consumer)."""
        return self._hub.shut

    @property
    def pulled(self) -> int:
        """Items read from the upstream so far (replays after restores included)."""
        return self._hub.pulled

    def consumer(self, index: int) -> FanOutConsumer[T]:
        """The consumer `index` (0 <= index < consumers), to read in this process; each
        index once."""
        self._hub.claim(index, "a consumer in this process")
        return FanOutConsumer(self, index)

    def serve(self, address: str) -> str:
        """Serve the consumers not taken in this process to processes of this host that
        ``attach(address, index)``; `address` is the path of a Unix socket to create: where
        no file is, or where an owner that died left its socket (nothing answers there;
        it is replaced). Returns `address`. Serving stops at `close`.

        Raises:
            ValueError: if another owner serves at `address`, or a file other than a
                socket is there."""
        from ..background.fanout_server import Server

        if self._server[0] is not None:
            raise RuntimeError(f"{NAME}: already serving at {self._server[0].address}")
        if self._hub.shut:
            raise RuntimeError(f"{NAME}.serve: the fan-out is closed")
        self._server[0] = Server(self._hub, address)
        return address

    def close_consumer(self, index: int) -> None:
        """Close consumer `index` from the owner (e.g. one whose process died for good)."""
        self._hub.close_consumer(index)

    def getstate(self) -> State:
        """The state of the whole fan-out (see Checkpoint)."""
        return self._book.getstate()

    def setstate(self, checkpoint: State | None) -> None:
        """Restore every consumer from `checkpoint` (None: the start)."""
        self._book.setstate(checkpoint)

    def close(self) -> None:
        """Stop serving, close every consumer and the upstream. Idempotent."""
        self._finalizer()
        if self._server[0] is not None:  # e.g. stopped by its last consumer's close
            self._server[0].join()

    def __enter__(self) -> FanOut[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _stop(hub: Hub, server: list[Any]) -> None:
    if server[0] is not None:
        server[0].shutdown()
    hub.close_all()
