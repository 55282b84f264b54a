"""A producer worker (a thread or a process) running `produce` over a source, behind a
bounded buffer; `receive` gives the consumer its next message."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

from .._core.graph import chain
from .._core.probe import WorkerStats
from .._core.protocol import CheckpointableIterator
from .._core.stage import fast_iterator, skip_items, source_state
from ..io._counts import ReadsSince
from . import shm, wire
from .errors import (
    ErrorReport,
    WorkerError,
    as_exception,
    died,
    local_error,
    report_error,
)
from .lifecycle import (
    LAST_WORDS_S,
    POLL_S,
    THREAD_STOP_S,
    Resource,
    check_interrupt,
    get_context,
    parent_alive,
    start_process,
    stop_process,
    worker_setup,
)
from .messages import Batch, End, Failure, Mark, Message
from .stacks import answers_dir
from .worker_gc import WorkerGC, worker_gc

logger = logging.getLogger("infinibatch_like")


class Production(NamedTuple):
    """What a producer worker runs: `produce`'s arguments."""

    source: CheckpointableIterator[Any]
    replay: int
    snapshot_every: int
    max_batch: int
    owner: str
    stats_every: int = 0
    """In a worker process: statistics' `sample_every` (0: off)."""


MESSAGE_BYTES = 64 * 1024
"""What a worker process aims to send per message (see `Pace`)."""


class Pace:
    """How many items a worker process puts in a message: up to `max_batch`, as many as
    fill about `MESSAGE_BYTES` once pickled. Enough to spread a message's fixed costs, and
    few enough that the consumer's copies of one message's items are freed before the
    garbage collector promotes them to older generations (a message of thousands of
    containers held while its items are served makes every collection costlier)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = self.limit = max_batch

    def sent(self, items: int, size: int) -> None:
        """A message of `items` items took `size` bytes pickled."""
        if items:
            self.limit = max(1, min(self.max_batch, items * MESSAGE_BYTES // max(1, size)))


def produce(production: Production, pace: Pace | None = None) -> Iterator[Message]:
    """The messages for the consumer of ``production.source``: batches of items, then
    `End`; an exception of the source is raised after the items that came before it.

    The source is where a checkpoint's snapshot points; `replay` items are skipped first,
    then a snapshot is taken (so a checkpoint never replays more than `snapshot_every`).
    Batches start at one item and double up to `max_batch` (<= `snapshot_every`: a fast
    first item, then few messages), or to ``pace.limit`` if a `pace` is given; every
    `snapshot_every` items a batch carries a `Mark`.
    """
    source, skip, every, max_batch, owner, _ = production
    pull = fast_iterator(source)
    skip_items(pull, skip, owner, "its source after the snapshot")
    getstate: Callable[[], Any] = partial(source_state, source)
    if skip:
        yield Batch([], Mark(0, getstate()))
    size, until_snapshot = 1, every
    while True:
        items: list[Any] = []
        mark = None
        try:
            if size <= until_snapshot:  # the common case: no snapshot inside this batch
                items.extend(islice(pull, size))  # keeps what came before an error
                until_snapshot -= len(items)
            else:
                items.extend(islice(pull, until_snapshot))
                if len(items) == until_snapshot:
                    mark = Mark(len(items), getstate())
                    items.extend(islice(pull, size - len(items)))
                    until_snapshot = every - (len(items) - mark.offset)
        except BaseException:
            if items or mark is not None:
                yield Batch(items, mark)
            raise
        if len(items) < size:
            if items:
                yield Batch(items, mark)
            yield End(getstate())
            return
        if until_snapshot == 0:
            mark, until_snapshot = Mark(size, getstate()), every
        yield Batch(items, mark)
        size = min(2 * size, max_batch if pace is None else pace.limit)


def _opened(message: Message) -> Message:
    if isinstance(message, Failure):
        raise as_exception(message.error)
    return message


class Channel(Resource):
    """A producer worker; `receive` returns its next `Batch` or `End`, or raises."""

    def receive(self) -> Batch | End:
        raise NotImplementedError

    def produced(self) -> int | None:
        """Items a worker process has produced so far (counted while statistics are on),
        or None where they are not counted (a worker thread: see `waiting`)."""
        return None

    def waiting(self) -> int:
        """Items waiting in this process's buffer now."""
        return 0


class ThreadChannel(Channel):
    """`messages` iterated by a daemon thread into a `queue.Queue` of `slots` messages.

    `where` names the thread in the notes of the exceptions it raises (None: passed on
    unchanged, they were described where they started). `upstream`, a channel that
    `messages` reads, is stopped with this one.
    """

    def __init__(
        self,
        messages: Iterator[Message],
        slots: int,
        name: str,
        warn_empty: bool,
        where: str | None,
        upstream: ProcessChannel | None = None,
        pipeline: object = None,
    ) -> None:
        super().__init__()
        self._queue: queue.Queue[Message] = queue.Queue(slots)
        self._stop = threading.Event()
        self._name, self._warn_empty, self._upstream = name, warn_empty, upstream
        self._thread = threading.Thread(
            target=self._run,
            args=(messages, where, pipeline),
            name=f"infinibatch_like.{name}.worker",
            daemon=True,
        )
        self._thread.start()

    def _run(self, messages: Iterator[Message], where: str | None, pipeline: object) -> None:
        put, stop = self._queue.put, self._stop
        try:
            for message in messages:
                put(message)
                if stop.is_set():
                    return
        except BaseException as error:
            if not stop.is_set():
                put(Failure(local_error(error, where, pipeline)))
        finally:
            messages.close()  # type: ignore[attr-defined]

    def receive(self) -> Batch | End:
        get = self._queue.get
        try:
            return _opened(get(False))  # type: ignore[return-value]
        except queue.Empty:
            pass
        if self._warn_empty:
            logger.warning("%s: the prefetch buffer is empty; waiting for its worker", self._name)
        while True:
            try:
                return _opened(get(True, POLL_S))  # type: ignore[return-value]
            except queue.Empty:
                check_interrupt()
                if not self._thread.is_alive():
                    try:
                        return _opened(get(False))  # type: ignore[return-value]
                    except queue.Empty:
                        raise WorkerError(
                            f"{self._name}: its worker thread stopped without a result"
                        ) from None

    def produced(self) -> int | None:
        return None if self._upstream is None else self._upstream.produced()

    def waiting(self) -> int:
        with self._queue.mutex:  # a snapshot: the worker thread puts meanwhile
            messages = list(self._queue.queue)
        return sum(len(getattr(message, "items", ())) for message in messages)

    def _shutdown(self) -> None:
        self._stop.set()
        if self._upstream is not None:  # the relay then sees its worker gone
            self._upstream.stop_worker()
        deadline = time.monotonic() + THREAD_STOP_S
        while self._thread.is_alive():
            try:  # unblock a worker waiting for room in the queue
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(0.01)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self._name}: its worker thread did not stop in {THREAD_STOP_S} s"
                )
        if self._upstream is not None:
            self._upstream.shutdown()


def thread_channel(production: Production, slots: int, warn_empty: bool) -> ThreadChannel:
    """`produce` in a worker thread."""
    name = production.owner
    where = f"in the worker thread of {name} (reading {chain(production.source)})"
    source = production.source
    return ThreadChannel(produce(production), slots, name, warn_empty, where, None, source)


def _relay(channel: ProcessChannel) -> Iterator[Message]:
    while True:
        message = channel.receive()
        yield message
        if isinstance(message, End):
            return


def buffered_channel(channel: ProcessChannel, slots: int, warn_empty: bool) -> ThreadChannel:
    """`channel`'s messages received ahead, by a thread of this process, into a buffer here."""
    name = channel.name
    return ThreadChannel(_relay(channel), slots, name, warn_empty, None, upstream=channel)


class _Outbox:
    """A worker process's bounded buffer of pickled messages, written to the consumer's
    pipe by a thread (so that producing overlaps with the consumer reading). It holds
    about `capacity` items: as many messages as `pace` puts that many items in."""

    def __init__(self, fd: int, capacity: int, pace: Pace, outgoing: shm.Outgoing | None) -> None:
        self._capacity, self._pace, self._outgoing = capacity, pace, outgoing
        self._queue: queue.Queue[bytes | None] = queue.Queue(self._slots())
        self._thread = threading.Thread(
            target=self._write, args=(fd,), name="infinibatch_like.outbox", daemon=True
        )
        self._thread.start()

    def _slots(self) -> int:
        return max(1, -(-self._capacity // self._pace.limit))

    def _write(self, fd: int) -> None:
        get = self._queue.get
        try:
            while (data := get()) is not None:
                wire.write_frame(fd, data)
        except OSError:  # the consumer closed the pipe: it is stopping this worker
            pass

    def put(self, message: Message) -> None:
        data = shm.encode(message, self._outgoing)
        if isinstance(message, Batch):
            self._pace.sent(len(message.items), len(data))
            # Only this thread puts: a smaller bound takes effect as the writer drains.
            self._queue.maxsize = self._slots()
        self._queue.put(data)

    def close(self) -> None:
        """Wait until everything put was written."""
        self._queue.put(None)
        self._thread.join()


def _producer_main(
    payload: bytes | None,
    production: Production,
    capacity: int,
    writer: Connection,
    parent: int,
    where: str,
    produced: Any,
    collector: WorkerGC,
    answers: str,
) -> None:
    """Entry point of a producer worker process; `produced` (a shared counter, None while
    statistics are off) counts the items it produces; `answers`: where it writes its
    stacks when asked (`stacks.answers_dir`)."""
    holder: list[Any] = [production.source]
    # Ahead by about `capacity` items, as when the pipe's bytes bounded it.
    outgoing = shm.Outgoing(max(2, capacity)) if shm.ENABLED else None

    closing = threading.Lock()
    closed: list[bool] = []

    def close_pipeline() -> None:
        """Once, by the main thread at the end or by the watch thread on SIGTERM (which
        may come while the main thread, at its end, waits for the consumer to take
        everything: it must not stop the pipeline's own workers under the other)."""
        with closing:
            if closed:
                return
            closed.append(True)
            if outgoing is not None:
                outgoing.unlink_names()
            if hasattr(holder[0], "close"):
                holder[0].close()

    worker_setup(parent, close_pipeline, collector, answers)
    pace = Pace(production.max_batch)
    outbox = _Outbox(writer.fileno(), capacity, pace, outgoing)
    position = production.replay  # of the next item, as the consumer's cursor counts
    try:
        if payload is not None:
            holder[0] = pickle.loads(payload)
        stats = WorkerStats(holder[0], production.stats_every) if production.stats_every else None
        reads = ReadsSince() if stats is not None else None
        for message in produce(production._replace(source=holder[0]), pace):
            if stats is not None and reads is not None:  # per message, not per item
                if isinstance(message, Batch):
                    produced.value += len(message.items)
                    if stats.due():
                        message = message._replace(stats=stats.delta(), reads=reads.delta())
                elif isinstance(message, End):
                    message = message._replace(stats=stats.delta(), reads=reads.delta())
            try:
                outbox.put(message)
            except Exception as error:
                failure = _unsent(message, position, where, outbox)
                outbox.put(Failure(failure or report_error(error, where, holder[0])))
                return
            if isinstance(message, Batch):
                position += len(message.items)
    except BaseException as error:
        outbox.put(Failure(report_error(error, where, holder[0])))
    finally:
        outbox.close()
        if outgoing is not None:  # the consumer maps what it reads: wait for it to
            outgoing.wait_taken(lambda: parent_alive(parent))
        close_pipeline()


def _unsent(message: Message, position: int, where: str, outbox: _Outbox) -> ErrorReport | None:
    """After `message` failed to pickle: if one of its items cannot be pickled, put the
    items before it (and the snapshot among them) and return the item's error, naming its
    source position (`position` is the message's first item's); else None (the message as
    a whole failed, and nothing is put)."""
    if not isinstance(message, Batch):
        return None
    found = wire.first_unpicklable(message.items)
    if found is None:
        return None
    index, cause = found
    mark = message.mark if message.mark is not None and message.mark.offset <= index else None
    if index or mark is not None:
        outbox.put(message._replace(items=message.items[:index], mark=mark))
    return report_error(
        cause,
        f"pickling the source's item at position {position + index} to send it to the "
        f"consumer, {where}",
    )


class ProcessChannel(Channel):
    """`produce` in a worker process, sending pickled messages on a pipe; about `capacity`
    items wait in the worker (plus what the pipe holds)."""

    def __init__(
        self, production: Production, capacity: int, warn_empty: bool, start_method: str | None
    ) -> None:
        name = self.name = production.owner
        context = get_context(name, start_method)
        method = context.get_start_method()
        reading = chain(production.source)
        payload = None
        if method != "fork":
            what = f"source pipeline ({reading})"
            payload = wire.dumps_for_worker(name, what, production.source, method)
            production = production._replace(source=None)  # type: ignore[arg-type]
        super().__init__()
        self._warn_empty = warn_empty
        where = f"in the worker process of {name} (start method {method!r}, reading {reading})"
        self._produced = context.RawValue("q", 0) if production.stats_every else None
        self._receiver, writer = context.Pipe(duplex=False)
        self._process: BaseProcess = context.Process(  # type: ignore[attr-defined]
            target=_producer_main,
            args=(
                payload,
                production,
                capacity,
                writer,
                os.getpid(),
                where,
                self._produced,
                worker_gc(),
                answers_dir(),
            ),
            name=f"infinibatch_like.{name}.worker",
            daemon=False,
        )
        try:
            start_process(self._process)
        except BaseException:
            self.shutdown()
            raise
        finally:
            writer.close()
        self._reader = wire.FrameReader(self._receiver.fileno())

    def _alive(self) -> bool:
        return self._process.exitcode is None

    def _waiting(self) -> bool:
        """`_alive`, checked while the consumer waits: a pending interrupt is raised."""
        check_interrupt()
        return self._alive()

    def pids(self) -> list[int]:
        pid = self._process.pid
        return [pid] if pid is not None and self._alive() else []

    def produced(self) -> int | None:
        return None if self._produced is None else int(self._produced.value)

    def receive(self) -> Batch | End:
        try:
            frame = self._reader.read(0)
        except EOFError:  # the worker is gone: said below
            frame = None
        if frame is None:
            if self._warn_empty:
                logger.warning(
                    "%s: the prefetch buffer is empty; waiting for its worker", self.name
                )
            frame = wire.read_until(self._reader, self._waiting, POLL_S, LAST_WORDS_S)
            if frame is None:
                self.stop_worker()
                raise died(self.name, self._process.pid, self._process.exitcode)
        return _opened(pickle.loads(frame))  # type: ignore[return-value]

    def stop_worker(self) -> None:
        """Stop the worker process (idempotent), unlink what segments it left unread;
        `shutdown` then releases the pipe."""
        if self._process._popen is not None:  # type: ignore[attr-defined]
            stop_process(self._process)
            shm.remove_names(self._process.pid)  # type: ignore[arg-type]

    def _shutdown(self) -> None:
        self.stop_worker()
        if self._process._popen is not None:  # type: ignore[attr-defined]
            self._process.close()
        self._receiver.close()
