"""The stacks of every thread of this process and of its worker processes, for reports of
stalls.

Every worker process answers `STACKS_SIGNAL` (from its watch thread, see
`lifecycle.worker_setup`, so a main thread blocked in C does not delay it): it writes the
stacks of its threads to `answer_path(pid)` (written aside, then renamed), and passes the
signal on to its own worker processes. The signal is sent only to workers whose handler
is in place (read from ``/proc/<pid>/status``): one still starting would be killed by it.

Answers go to a private directory (`answers_dir`: an unpredictable name, created with
mode 0700 by the first report that asks for stacks, removed when its maker exits), which a
consumer hands to the workers it starts and they to theirs: nothing that another user
plants in a shared temporary directory is read, followed or removed.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable

STACKS_SIGNAL = signal.SIGUSR2
"""The signal that asks a worker process for its stacks."""

CHILDREN_PREFIX = "child worker processes: "


def thread_stacks() -> str:
    """The stack of every thread of this process, each under its name."""
    frames = sys._current_frames()
    parts = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is None:
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{thread.name}" (ident {thread.ident}):\n{stack}')
    return "\n".join(parts)


_ANSWERS: list[str] = []
"""The path of `answers_dir`, once chosen here or handed down by `use_answers_dir`."""


def answers_dir() -> str:
    """Where this process's worker processes (and theirs) write their stacks when asked:
    a directory of an unpredictable name (96 random bits) in the temporary directory,
    chosen at the first call; `open_answers_dir` creates it when a report needs it."""
    if not _ANSWERS:
        name = f"infinibatch_like-stacks-{secrets.token_hex(12)}"
        _ANSWERS.append(os.path.join(tempfile.gettempdir(), name))
    return _ANSWERS[0]


def open_answers_dir() -> str:
    """`answers_dir`, created now (mode 0700) if it does not exist, and removed when this
    process exits (by atexit, and by a multiprocessing finalizer in a multiprocessing
    child such as a DataLoader worker, whose exit skips atexit).

    Raises:
        PermissionError: if something else is at its path: a symlink, a file, or a
            directory of another user or that others may write.
    """
    path = answers_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        found = os.lstat(path)
        if (
            not stat.S_ISDIR(found.st_mode)
            or found.st_uid != os.getuid()
            or found.st_mode & 0o077
        ):
            raise PermissionError(
                f"{path} exists and is not a private directory of this user: the worker "
                "processes are not asked for their stacks"
            ) from None
        return path
    maker = os.getpid()
    atexit.register(_remove_answers, path, maker)
    multiprocessing.util.Finalize(None, _remove_answers, (path, maker), exitpriority=0)
    return path


def use_answers_dir(path: str) -> None:
    """In a worker process: answer in `path`, the `answers_dir` of the consumer that
    started it (and hand it on to this worker's own workers)."""
    _ANSWERS[:] = [path]


def _remove_answers(path: str, maker: int) -> None:
    if os.getpid() == maker:  # not in a forked child that inherited the exit handler
        shutil.rmtree(path, ignore_errors=True)


def answer_path(pid: int) -> str:
    """Where worker process `pid` writes its stacks when asked."""
    return os.path.join(answers_dir(), f"{pid}.txt")


def answer_stacks_request(children: Iterable[int]) -> None:
    """In a worker process: write this process's stacks for the requester (to a file of
    mode 0600, renamed into place once complete), and pass the request on to `children`
    (its own worker processes)."""
    asked = request(children)
    path = answer_path(os.getpid())
    text = f"{CHILDREN_PREFIX}{' '.join(map(str, asked))}\n{thread_stacks()}"
    descriptor, aside = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
    try:
        with open(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(aside, path)
    except BaseException:
        _remove(aside)
        raise


def answers_signal(pid: int) -> bool:
    """Whether process `pid` has a handler for `STACKS_SIGNAL` (Linux; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (STACKS_SIGNAL - 1) & 1)
    except OSError:
        pass
    return False


def request(pids: Iterable[int]) -> list[int]:
    """Ask each of `pids` that can answer for its stacks; those asked."""
    asked = []
    for pid in pids:
        if answers_signal(pid):
            try:
                os.kill(pid, STACKS_SIGNAL)
            except OSError:
                continue
            asked.append(pid)
    return asked


def worker_stacks(pids: Iterable[int], timeout: float) -> str:
    """The stacks of the worker processes `pids` and of their own workers, waiting up to
    `timeout` seconds for their answers; a worker whose answer cannot be read is named
    with the reason, and the others are still reported."""
    pending = {pid: answer_path(pid) for pid in pids}
    if pending:
        open_answers_dir()
    for path in pending.values():  # an answer left from an earlier request
        _remove(path)
    unanswered = set(pending) - set(request(pending))
    parts = [f"Worker process {pid}: cannot be asked for its stacks" for pid in unanswered]
    for pid in unanswered:
        del pending[pid]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for pid, path in list(pending.items()):
            try:
                with open(path, encoding="utf-8") as file:
                    text = file.read()
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError) as error:
                del pending[pid]
                parts.append(f"Worker process {pid}: its answer cannot be read ({error})")
                continue
            _remove(path)
            del pending[pid]
            header, _, stacks = text.partition("\n")
            children = [int(child) for child in header[len(CHILDREN_PREFIX) :].split()]
            pending.update((child, answer_path(child)) for child in children)
            parts.append(f"Worker process {pid}:\n{stacks}")
        time.sleep(0.02)
    parts.extend(f"Worker process {pid}: no answer within {timeout} s" for pid in pending)
    return "\n".join(parts)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
