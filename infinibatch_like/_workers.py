"""Private plumbing of the background stages (`PrefetchIterator`, `ParallelMapIterator`).

What lives here:

- `produce`: the loop a background worker runs over a source pipeline. It sends items in
  small batches and, every ``snapshot_every`` items, the source's state, so that the
  consumer can checkpoint exactly (snapshot + number of items consumed since it).
- `ThreadChannel`, `ProcessChannel`: a worker (thread or process) running `produce`,
  behind a bounded queue, with liveness checks (a dead worker raises `WorkerError`
  within `POLL_S` seconds of being noticed instead of hanging).
- `MapPool`: worker processes that apply a transform to numbered tasks.
- error transport: an exception in a worker is re-raised in the consumer with the
  worker's traceback text (as ``__cause__``) and a note naming the stage.
- a registry of live workers, shut down at interpreter exit (before `multiprocessing`'s
  own exit handler, which would otherwise join non-daemonic workers forever).

Items cross process boundaries as plain ``pickle`` bytes (protocol 5). This bypasses the
reductions that ``torch.multiprocessing`` installs into multiprocessing's pickler (shared
memory through file descriptors, which stalls or leaks descriptors when a worker goes
away): a tensor costs one copy each way, never a descriptor.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from itertools import islice
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import FrameType, TracebackType
from typing import Any, NamedTuple, NoReturn

from ._base import Stage, State, StateMismatchError, fast_iterator

logger = logging.getLogger("infinibatch_like")

POLL_S = 0.1
"""How often a waiting consumer checks that its workers are alive (seconds)."""

JOIN_S = 5.0
"""How long a worker may take to stop before it is killed (seconds)."""

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

ITEMS, END, ERROR = "items", "end", "error"

Message = tuple[str, Any, Any]
Report = tuple[str, str, str, str, bytes | None]
"""(where, exception type name, message, traceback text, pickled exception or None)."""


class WorkerError(RuntimeError):
    """A background worker died, or failed with an exception that cannot be re-raised."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (set as ``__cause__``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


# -- start methods -------------------------------------------------------------------------


def get_context(owner: str, start_method: str | None) -> BaseContext:
    """The multiprocessing context of `start_method` (None: the platform's default)."""
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(
            f"{owner}: start_method must be one of {methods} or None, got {start_method!r}"
        )
    return multiprocessing.get_context(start_method)


def pickled_for_spawn(owner: str, what: str, value: object, method: str) -> bytes:
    """Pickle `value` to send it to a worker started by `method`, or raise a clear error."""
    try:
        return pickle.dumps(value, PICKLE_PROTOCOL)
    except Exception as error:
        raise pickle.PicklingError(
            f"{owner}: cannot send its {what} to a worker process started with "
            f"{method!r} ({type(error).__name__}: {error}). Under 'spawn' and 'forkserver' "
            "everything in the pipeline must pickle: use module-level functions or "
            "functools.partial instead of lambdas and local functions, or use "
            "start_method='fork' or mode='thread'"
        ) from error


# -- error transport ---------------------------------------------------------------------


def chain_names(source: object) -> str:
    """``"MapIterator > SelectManyIterator > ..."``: the stages of a pipeline, outermost first."""
    names: list[str] = []
    current: object = source
    while True:
        names.append(type(current).__name__)
        upstream: tuple[Any, ...] = current._sources if isinstance(current, Stage) else ()
        if len(upstream) != 1 or len(names) > 12:
            if len(upstream) > 1:
                names.append("(...)")
            return " > ".join(names)
        current = upstream[0]


def _raising_stage(trace: TracebackType | None) -> str | None:
    """The innermost stage whose method or generator is in `trace`, if any."""
    found = None
    while trace is not None:
        candidate = trace.tb_frame.f_locals.get("self")
        if isinstance(candidate, Stage):
            found = type(candidate).__name__
        trace = trace.tb_next
    return found


def error_report(error: BaseException, where: str) -> Report:
    """Describe `error` so that the consumer can re-raise it (see `raise_report`)."""
    stage = _raising_stage(error.__traceback__)
    if stage is not None:
        where = f"{where}; raised in {stage}"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    blob: bytes | None = None
    try:
        pickled = pickle.dumps(error, PICKLE_PROTOCOL)
        pickle.loads(pickled)
        blob = pickled
    except Exception:
        pass
    return (where, type(error).__qualname__, str(error), text, blob)


def _add_note(error: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        error.add_note(note)


def raise_report(report: Report) -> NoReturn:
    """Re-raise a worker's exception in the consumer (its type when it unpickles)."""
    where, type_name, message, text, blob = report
    remote = RemoteTraceback(f"\n\nTraceback in the worker ({where}):\n{text}")
    error: BaseException | None = None
    if blob is not None:
        try:
            error = pickle.loads(blob)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        raise WorkerError(f"{type_name}: {message} (raised {where}){remote}") from None
    _add_note(error, f"(raised {where}; the worker's traceback is shown above)")
    raise error from remote


def raise_local(error: BaseException, where: str) -> NoReturn:
    """Re-raise an exception caught in a worker thread, naming where it came from."""
    _add_note(error, f"(raised {where})")
    raise error


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


# -- the live-worker registry ------------------------------------------------------------


class Resource:
    """Something with background workers; `shutdown` stops them and is idempotent."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        _LIVE.add(self)

    def owned(self) -> bool:
        """Whether this process started the workers (a forked child inherits copies)."""
        return os.getpid() == self._owner

    def shutdown(self) -> None:
        _LIVE.discard(self)
        if self.owned():
            self._shutdown()

    def _shutdown(self) -> None:
        raise NotImplementedError


_LIVE: set[Resource] = set()


def _shutdown_all() -> None:
    for resource in list(_LIVE):
        try:
            resource.shutdown()
        except Exception:  # interpreter exit: stop the others anyway
            logger.exception("infinibatch_like: error while stopping a background worker")


# Registered after multiprocessing.util's handler, so it runs first (atexit is LIFO): our
# workers are not daemonic (they may start workers of their own) and must be stopped
# before multiprocessing joins its non-daemonic children.
atexit.register(_shutdown_all)


def stop_process(process: BaseProcess, grace: float = JOIN_S) -> None:
    """Terminate `process` (SIGTERM, then SIGKILL after `grace` seconds), reap and close it."""
    if process.exitcode is None:
        process.terminate()
        process.join(grace)
        if process.exitcode is None:
            process.kill()
            process.join(grace)
    process.close()


def close_mp_queue(channel: Any) -> None:
    """Close a multiprocessing queue in this process so that no thread or descriptor
    outlives it, even when its feeder thread is blocked writing into a pipe that no
    (dead) worker reads anymore: what is left in the pipe is read and discarded."""
    feeder = getattr(channel, "_thread", None)
    reader = channel._reader
    if feeder is None:  # nothing was put here: no feeder thread, close both ends
        channel.close()
        reader.close()
        channel._writer.close()
        return

    def discard(wait: float) -> bool:
        try:  # raw reads: a killed worker may have left half a message in the pipe
            if reader.poll(wait):
                os.read(reader.fileno(), 1 << 16)
        except (OSError, EOFError, TypeError, ValueError):  # closed by the feeder meanwhile
            return False
        return True

    deadline = time.monotonic() + JOIN_S
    buffered = channel._buffer
    while feeder.is_alive() and (buffered or reader.poll(0)) and time.monotonic() < deadline:
        discard(0.01)
    channel.close()  # the feeder writes what it holds, then closes both ends and exits
    while feeder.is_alive() and time.monotonic() < deadline:
        feeder.join(0.05)
        if feeder.is_alive() and not discard(0):
            break
    if feeder.is_alive():
        channel.cancel_join_thread()
    channel.join_thread()


# -- the producer loop -------------------------------------------------------------------


def produce(
    source: Iterator[Any], replay: int, snapshot_every: int, max_batch: int
) -> Iterator[Message]:
    """Messages for the consumer of `source`: ``(ITEMS, items, mark)`` and, at the end,
    ``(END, final state, None)``.

    The source is where a checkpoint's snapshot points; `replay` items are skipped first.
    Batches start at one item and double up to `max_batch` (<= `snapshot_every`: a fast
    first item, then few messages). After every `snapshot_every` items the source's state
    is taken; the batch holding that point carries it as ``mark = (state, offset)``: the
    state right after ``items[:offset]`` (None when the batch holds no such point).
    """
    pull = fast_iterator(source)
    for index in range(replay):
        try:
            next(pull)
        except StopIteration:
            raise StateMismatchError(
                f"the checkpoint replays {replay} items after its snapshot, but the source "
                f"ends after {index}",
                (type(source).__name__,),
            ) from None
    size, until_snapshot = 1, snapshot_every
    getstate: Callable[[], State] = source.getstate  # type: ignore[attr-defined]
    while True:
        if size <= until_snapshot:  # the common case: no snapshot inside this batch
            items = list(islice(pull, size))
            mark = None
            until_snapshot -= len(items)
        else:
            items = list(islice(pull, until_snapshot))
            mark = None
            if len(items) == until_snapshot:
                mark = (getstate(), len(items))
                items.extend(islice(pull, size - len(items)))
                until_snapshot = snapshot_every - (len(items) - mark[1])
        if len(items) < size:
            if items:
                yield ITEMS, items, mark
            yield END, getstate(), None
            return
        if until_snapshot == 0:
            mark, until_snapshot = (getstate(), size), snapshot_every
        yield ITEMS, items, mark
        if size < max_batch:
            size = min(2 * size, max_batch)


# -- channels: one producer worker behind a bounded queue ----------------------------------


class Channel(Resource):
    """A worker running `produce` over a source; `receive` returns its next message."""

    where: str
    _name: str
    _warn_empty: bool
    _last_words_s: float
    """How long to wait for what a stopped worker put in the queue before it stopped."""

    def receive(self) -> Message:
        raise NotImplementedError

    def _wait(self, get: Callable[[bool, float | None], Any]) -> Any:
        """The next entry of the queue read by `get`: at once if there is one, else after
        waiting, checking every `POLL_S` seconds that the worker is alive."""
        try:
            return get(False, None)
        except queue.Empty:
            pass
        if self._warn_empty:
            logger.warning("%s: the prefetch buffer is empty; waiting for its worker", self._name)
        while True:
            try:
                return get(True, POLL_S)
            except queue.Empty:
                if self._worker_alive():
                    continue
            try:  # whatever it sent before it stopped
                return get(True, self._last_words_s)
            except queue.Empty:
                raise self._died() from None

    def _worker_alive(self) -> bool:
        raise NotImplementedError

    def _died(self) -> WorkerError:
        raise NotImplementedError


class ThreadChannel(Channel):
    """`messages` iterated by a daemon thread and passed by reference through a
    `queue.Queue` of `slots` messages.

    `where` names the thread in the notes of the exceptions it raises; with ``where=None``
    they are passed on unchanged (they were described where they started).
    """

    def __init__(
        self,
        messages: Iterator[Message],
        slots: int,
        name: str,
        warn_empty: bool,
        where: str | None,
        upstream: Channel | None = None,
    ) -> None:
        super().__init__()
        self.where = where or ""
        self._queue: queue.Queue[Message] = queue.Queue(slots)
        self._stop = threading.Event()
        self._warn_empty = warn_empty
        self._name = name
        self._upstream = upstream
        self._thread = threading.Thread(
            target=self._run,
            args=(messages, where),
            name=f"infinibatch_like.{name}.worker",
            daemon=True,
        )
        self._thread.start()

    def _run(self, messages: Iterator[Message], where: str | None) -> None:
        put, stop = self._queue.put, self._stop
        try:
            for message in messages:
                put(message)
                if stop.is_set():
                    return
        except BaseException as error:
            if not stop.is_set():
                put((ERROR, error, where))
        finally:
            messages.close()  # type: ignore[attr-defined]

    _last_words_s = 0.0

    def receive(self) -> Message:
        message: Message = self._wait(self._queue.get)
        if message[0] == ERROR:
            if message[2] is None:
                raise message[1]
            raise_local(message[1], message[2])
        return message

    def _worker_alive(self) -> bool:
        return self._thread.is_alive()

    def _died(self) -> WorkerError:
        return WorkerError(f"{self._name}: its worker thread stopped without a result")

    def _shutdown(self) -> None:
        self._stop.set()
        if self._upstream is not None:  # unblocks a relay waiting for the worker process
            self._upstream.shutdown()
        deadline = time.monotonic() + 60.0
        while self._thread.is_alive():
            try:  # unblock a worker waiting for room in the queue
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(0.01)
            if time.monotonic() > deadline:
                raise WorkerError(f"{self._name}: its worker thread did not stop in 60 s")


class Production(NamedTuple):
    """The arguments of `produce`: what a producer worker runs."""

    source: Iterator[Any]
    replay: int
    snapshot_every: int
    max_batch: int


def thread_channel(
    production: Production, slots: int, name: str, warn_empty: bool
) -> ThreadChannel:
    """`produce` in a worker thread."""
    where = f"in the worker thread of {name} (reading {chain_names(production.source)})"
    return ThreadChannel(produce(*production), slots, name, warn_empty, where)


def _relay(channel: Channel) -> Iterator[Message]:
    while True:
        message = channel.receive()
        yield message
        if message[0] == END:
            return


def buffered_channel(channel: Channel, slots: int, name: str, warn_empty: bool) -> ThreadChannel:
    """`channel`'s messages received ahead, by a thread of this process, into a buffer here."""
    return ThreadChannel(_relay(channel), slots, name, warn_empty, None, upstream=channel)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _process_worker(
    payload: bytes | None,
    source: Iterator[Any] | None,
    replay: int,
    every: int,
    max_batch: int,
    channel: Any,
    parent: int,
    where: str,
) -> None:
    """Entry point of a prefetch worker process."""
    _ignore_interrupts()
    holder: list[Any] = [source]

    def on_terminate(signum: int, frame: FrameType | None) -> None:
        # Exit right here: unwinding from an arbitrary point could leave a lock of the
        # queue held and block the exit handlers. Nested workers are stopped first.
        try:
            if hasattr(holder[0], "close"):
                holder[0].close()
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_terminate)

    def send(message: Message) -> None:
        data = pickle.dumps(message, PICKLE_PROTOCOL)
        while True:
            try:
                channel.put(data, True, 1.0)
                return
            except queue.Full:
                if os.getppid() != parent:  # the consumer is gone
                    on_terminate(signal.SIGTERM, None)

    try:
        if payload is not None:
            holder[0] = pickle.loads(payload)
        for message in produce(holder[0], replay, every, max_batch):
            send(message)
    except BaseException as error:
        send((ERROR, error_report(error, where), None))
    finally:
        if hasattr(holder[0], "close"):
            holder[0].close()


class ProcessChannel(Channel):
    """`produce` in a worker process; messages are pickled bytes in a bounded queue."""

    def __init__(
        self,
        production: Production,
        slots: int,
        name: str,
        warn_empty: bool,
        start_method: str | None,
    ) -> None:
        source, replay, snapshot_every, max_batch = production
        context = get_context(name, start_method)
        method = context.get_start_method()
        payload = None
        if method != "fork":
            payload = pickled_for_spawn(
                name, f"source pipeline ({chain_names(source)})", source, method
            )
        super().__init__()
        self._name = name
        self._warn_empty = warn_empty
        self._queue: Any = context.Queue(slots)
        self.where = (
            f"in the worker process of {name} (start method {method!r}, reading "
            f"{chain_names(source)})"
        )
        self._process: BaseProcess = context.Process(  # type: ignore[attr-defined]
            target=_process_worker,
            args=(
                payload,
                None if payload is not None else source,
                replay,
                snapshot_every,
                max_batch,
                self._queue,
                os.getpid(),
                self.where,
            ),
            name=f"infinibatch_like.{name}.worker",
            daemon=False,
        )
        try:
            self._process.start()
        except BaseException:
            _LIVE.discard(self)
            close_mp_queue(self._queue)
            raise
        self._pid = self._process.pid

    _last_words_s = 0.5

    def receive(self) -> Message:
        message: Message = pickle.loads(self._wait(self._queue.get))
        if message[0] == ERROR:
            raise_report(message[1])
        return message

    def _worker_alive(self) -> bool:
        return self._process.exitcode is None

    def _died(self) -> WorkerError:
        return WorkerError(
            f"{self._name}: its worker process (pid {self._pid}) died unexpectedly "
            f"({describe_exit(self._process.exitcode)}); call setstate() with a checkpoint "
            "to start a new one"
        )

    def _shutdown(self) -> None:
        stop_process(self._process)
        close_mp_queue(self._queue)


# -- the worker pool of ParallelMapIterator ------------------------------------------------


def _map_worker(
    payload: bytes | None,
    transform: Callable[[Any], Any] | None,
    tasks: Any,
    results: Any,
    parent: int,
    where: str,
) -> None:
    """Entry point of a ParallelMapIterator worker process."""
    _ignore_interrupts()
    results.cancel_join_thread()  # never block exit on results nobody will read
    if payload is not None:
        transform = pickle.loads(payload)
    assert transform is not None
    while True:
        try:
            task = tasks.get(True, 1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        number, data = task
        outputs: list[Any] = []
        report: Report | None = None
        try:
            outputs.extend(map(transform, pickle.loads(data)))
        except Exception as error:
            report = error_report(error, where)
        try:
            blob = pickle.dumps(outputs, PICKLE_PROTOCOL)
        except Exception as error:
            blob = pickle.dumps([], PICKLE_PROTOCOL)
            report = error_report(error, f"{where}, pickling the transform's outputs")
        results.put((number, blob, report))


class MapPool(Resource):
    """`num_processes` processes applying `transform` to tasks ``(number, items)``."""

    def __init__(
        self,
        transform: Callable[[Any], Any],
        num_processes: int,
        name: str,
        start_method: str | None,
    ) -> None:
        context = get_context(name, start_method)
        method = context.get_start_method()
        payload = None
        if method != "fork":
            payload = pickled_for_spawn(name, f"transform {transform!r}", transform, method)
        super().__init__()
        self._name = name
        self.where = f"in a worker process of {name}, in its transform {transform!r}"
        self._tasks: Any = context.Queue()
        self._results: Any = context.Queue()
        self._processes: list[BaseProcess] = []
        try:
            for index in range(num_processes):
                process: BaseProcess = context.Process(  # type: ignore[attr-defined]
                    target=_map_worker,
                    args=(
                        payload,
                        None if payload is not None else transform,
                        self._tasks,
                        self._results,
                        os.getpid(),
                        self.where,
                    ),
                    name=f"infinibatch_like.{name}.worker-{index}",
                    daemon=False,
                )
                process.start()
                self._processes.append(process)
        except BaseException:
            self.shutdown()
            raise

    def submit(self, number: int, items: list[Any]) -> None:
        self._tasks.put((number, pickle.dumps(items, PICKLE_PROTOCOL)))

    def receive(self) -> tuple[int, list[Any], Report | None]:
        get = self._results.get
        while True:
            # Checked before every task: a dead worker may have taken none of the tasks
            # the consumer waits for, while the others keep everything flowing.
            for process in self._processes:
                if process.exitcode is not None:
                    raise WorkerError(
                        f"{self._name}: its worker process (pid {process.pid}) died "
                        f"unexpectedly ({describe_exit(process.exitcode)}); call "
                        "setstate() with a checkpoint to start new ones"
                    )
            try:
                number, blob, report = get(True, POLL_S)
                return number, pickle.loads(blob), report
            except queue.Empty:
                continue

    def _shutdown(self) -> None:
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()
        for process in self._processes:
            stop_process(process)
        self._processes = []
        close_mp_queue(self._tasks)
        close_mp_queue(self._results)
