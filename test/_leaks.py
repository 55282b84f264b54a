"""What a test counts to show that nothing outlives a pipeline: descriptors and pipes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Any


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_pipes() -> int:
    """The pipes among this process's descriptors (what background workers use)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(target.startswith("pipe:") for target in targets)


def children() -> list[Any]:
    """This process's live child processes (what must be gone after close)."""
    return multiprocessing.active_children()
