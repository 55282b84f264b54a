"""Worker processes and threads: start methods, start and stop, the registry of live
workers, what every worker process does first, and the timeouts of the layer.

Every worker process watches its parent: when the parent is gone (killed, or exited
without stopping it), the worker closes its pipeline and exits within
`PARENT_CHECK_S`. So workers never outlive their consumer, even when started from a
daemonic process (a DataLoader worker), where multiprocessing would refuse them.
"""

from __future__ import annotations

import atexit
import errno
import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import select
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from . import segments, stacks, worker_gc

logger = logging.getLogger("infinibatch_like")

R = TypeVar("R")

POLL_S = 0.1
"""How often a waiting consumer checks that its workers are alive (seconds)."""

JOIN_S = 5.0
"""How long a worker may take to stop before it is killed (seconds)."""

LAST_WORDS_S = 0.5
"""How long the consumer reads what a worker process sent just before it died (seconds)."""

PARENT_CHECK_S = 0.5
"""How often a worker process checks that its parent is alive (seconds)."""

THREAD_STOP_S = 60.0
"""How long a worker thread may take to stop before `close()` gives up on it (seconds)."""


_INTERRUPTS: dict[int, BaseException] = {}


def interrupt(thread: int, error: BaseException) -> None:
    """Make the consumer thread `thread` raise `error` where it waits for a background
    stage (it checks every `POLL_S` while waiting: a point where it holds no lock)."""
    _INTERRUPTS[thread] = error


def cancel_interrupt(thread: int) -> bool:
    """Withdraw an `interrupt` not raised yet; whether there was one."""
    return _INTERRUPTS.pop(thread, None) is not None


def check_interrupt() -> None:
    """Raise the error of an `interrupt` of this thread, if there is one (called by the
    consumer's wait loops, not per item)."""
    if _INTERRUPTS:
        error = _INTERRUPTS.pop(threading.get_ident(), None)
        if error is not None:
            raise error


def wait_for(
    attempt: Callable[[float], R],
    alive: Callable[[], bool],
    last_words_s: float = 0.0,
    poll_s: float = POLL_S,
) -> R:
    """The consumer's one wait loop: the first result of ``attempt(poll_s)`` (an attempt
    waits up to that long) that is not None. Between attempts, a pending `interrupt` of
    this thread is raised and `alive` asked (is the worker still there?); once it is
    not, one more ``attempt(last_words_s)`` gives what the worker left (None: nothing)."""
    while True:
        result = attempt(poll_s)
        if result is not None:
            return result
        check_interrupt()
        if not alive():
            return attempt(last_words_s)


def queue_get(entries: queue.Queue[R] | queue.SimpleQueue[R], timeout: float) -> R | None:
    """The next of `entries`, waiting up to `timeout` seconds (None: none came): the
    `attempt` of a `wait_for` on a worker thread's queue."""
    try:
        return entries.get(True, timeout)
    except queue.Empty:
        return None


def get_context(owner: str, start_method: str | None) -> BaseContext:
    """The multiprocessing context of `start_method` (None: the platform's default)."""
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(
            f"{owner}: start_method must be one of {methods} or None, got {start_method!r}"
        )
    return multiprocessing.get_context(start_method)


# -- the live-worker registry ------------------------------------------------------------


class Resource:
    """Something with background workers; `shutdown` stops them and is idempotent."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        _register_exit_handler()
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

    def pids(self) -> list[int]:
        """The process ids of its live worker processes (none for threads)."""
        return []


def worker_pids() -> list[int]:
    """The process ids of this process's live worker processes."""
    return [pid for resource in list(_LIVE) if resource.owned() for pid in resource.pids()]


_LIVE: set[Resource] = set()
_HANDLER_PID: list[int] = []


def _shutdown_all() -> None:
    for resource in list(_LIVE):
        try:
            resource.shutdown()
        except Exception:  # exiting: stop the others anyway
            logger.exception("infinibatch_like: error while stopping a background worker")


def _register_exit_handler() -> None:
    """Stop this process's workers when it exits, before multiprocessing joins its
    children: as a multiprocessing finalizer (run by the exit of the main process and of
    multiprocessing's worker processes, where atexit handlers do not run) and by atexit."""
    if [os.getpid()] == _HANDLER_PID:
        return
    _HANDLER_PID[:] = [os.getpid()]
    multiprocessing.util.Finalize(None, _shutdown_all, exitpriority=100)


# Registered after multiprocessing.util's own handler, so it runs first (atexit is LIFO).
atexit.register(_shutdown_all)
os.register_at_fork(after_in_child=_LIVE.clear)


# -- processes -----------------------------------------------------------------------------


def start_process(process: BaseProcess) -> None:
    """Start `process`, also from a daemonic process (a DataLoader worker), which
    multiprocessing refuses: the parent watch of `worker_setup` stops it with its parent.
    Raises `ProcessesRefused` where the platform does not allow a child process."""
    config: dict[str, Any] = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemonic = config.get("daemon", False)
    config["daemon"] = False
    try:
        segments.share_tracker()  # the worker's segments are registered with this one
        process.start()
    except (AssertionError, PermissionError) as error:  # a platform without child processes
        raise ProcessesRefused(f"cannot start {process.name}") from error
    except OSError as error:
        if error.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            raise
        raise ProcessesRefused(f"cannot start {process.name}") from error
    finally:
        config["daemon"] = daemonic


class ProcessesRefused(Exception):
    """This platform refuses to start a worker process (raised by `start_process`)."""


_FALLBACK_WARNED: list[bool] = []


def warn_thread_fallback(owner: str, error: ProcessesRefused) -> None:
    """Log, once per process, that background stages use threads instead of processes."""
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED.append(True)
        logger.warning(
            "%s: this platform refuses to start worker processes here (%s); background "
            "stages run their workers in threads instead",
            owner,
            error.__cause__,
        )


def stop_process(process: BaseProcess, grace: float = JOIN_S) -> None:
    """Terminate `process` (SIGTERM, then SIGKILL after `grace` seconds) and reap it."""
    if process.exitcode is None:
        process.terminate()
        process.join(grace)
        if process.exitcode is None:
            process.kill()
            process.join(grace)


def parent_alive(parent: int) -> bool:
    """Whether process `parent` exists (zombies included, until reaped)."""
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid was reused by another user's process
        return False
    return True


def worker_setup(
    parent: int, on_exit: Callable[[], None], collector: worker_gc.WorkerGC, answers: str
) -> None:
    """What a worker process does first: set its garbage `collector` (`set_worker_gc`, as
    the consumer had it when it started the worker), leave Ctrl-C to its consumer, run
    `on_exit` then exit at once on SIGTERM or when `parent` is gone (checked every
    `PARENT_CHECK_S`), run torch's operations on one thread where torch is imported (as
    DataLoader workers do; GNU OpenMP hangs in a forked child whose parent has run its
    threads), and answer requests for its stacks (`stacks.STACKS_SIGNAL`, e.g.
    from a `Watchdog`) in the consumer's private directory `answers`
    (`stacks.answers_dir`).

    Both are watched by a thread of its own. A SIGTERM reaches it through the signal
    wakeup descriptor, whichever thread the signal lands on: a handler would run only in
    the main thread, and only once that thread returns from what blocks it (e.g. writing
    a result to a full pipe), which a signal taken by another thread does not interrupt."""
    worker_gc.apply(collector)
    torch = sys.modules.get("torch")
    if torch is not None:  # as DataLoader workers: one thread for torch's operations, which
        torch.set_num_threads(1)  # a fork of a process that ran its OpenMP threads needs
    stacks.use_answers_dir(answers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wakeup_reader, wakeup_writer = os.pipe()
    os.set_blocking(wakeup_writer, False)
    signal.set_wakeup_fd(wakeup_writer, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # taken by the watch thread
    signal.signal(stacks.STACKS_SIGNAL, lambda *_: None)  # likewise
    signals = select.poll()
    signals.register(wakeup_reader, select.POLLIN)
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid and parent_alive(parent):
            if not signals.poll(1000 * PARENT_CHECK_S):
                continue
            received = os.read(wakeup_reader, 64)
            if signal.SIGTERM in received:
                break
            if stacks.STACKS_SIGNAL in received:
                try:
                    stacks.answer_stacks_request(worker_pids())
                except Exception:  # a report must never stop the worker
                    logger.exception("infinibatch_like: could not report a worker's stacks")
        # Exit right here: unwinding the main thread could leave a lock held.
        try:
            on_exit()
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="infinibatch_like.parent-watch", daemon=True).start()
