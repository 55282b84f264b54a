"""The stacks of every thread of this process and of its worker processes, for reports of
stalls.

Every worker process answers `STACKS_SIGNAL` (from its watch thread, see
`lifecycle.worker_setup`, so a main thread blocked in C does not delay it): it writes the
stacks of its threads to `stacks_path(pid)` (written aside, then renamed), and passes the
signal on to its own worker processes. The signal is sent only to workers whose handler
is in place (read from ``/proc/<pid>/status``): one still starting would be killed by it.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


def stacks_path(pid: int) -> str:
    """Where worker process `pid` writes its stacks when asked."""
    return os.path.join(tempfile.gettempdir(), f"infinibatch_like-stacks-{pid}.txt")


def answer_stacks_request(children: Iterable[int]) -> None:
    """In a worker process: write this process's stacks for the requester, and pass the
    request on to `children` (its own worker processes)."""
    asked = request(children)
    path = stacks_path(os.getpid())
    text = f"{CHILDREN_PREFIX}{' '.join(map(str, asked))}\n{thread_stacks()}"
    aside = f"{path}.{threading.get_ident()}.part"
    with open(aside, "w", encoding="utf-8") as file:
        file.write(text)
    os.replace(aside, path)


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
    `timeout` seconds for their answers."""
    pending = {pid: stacks_path(pid) for pid in pids}
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
            _remove(path)
            del pending[pid]
            header, _, stacks = text.partition("\n")
            children = [int(child) for child in header[len(CHILDREN_PREFIX) :].split()]
            pending.update((child, stacks_path(child)) for child in children)
            parts.append(f"Worker process {pid}:\n{stacks}")
        time.sleep(0.02)
    parts.extend(f"Worker process {pid}: no answer within {timeout} s" for pid in pending)
    return "\n".join(parts)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
