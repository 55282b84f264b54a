"""What a test counts to show that nothing outlives a pipeline: descriptors and pipes."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Any


def _own_fds() -> list[str]:
    """This process's descriptors, less the pipe to multiprocessing's resource tracker
    (started once, with the first worker process, and kept: the shared-memory transport
    registers its segments there)."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_fd", None)
    return [fd for fd in os.listdir("/proc/self/fd") if fd != str(tracker)]


def open_fds() -> int:
    return len(_own_fds())


def fd_targets() -> dict[str, str]:
    """This process's descriptors (as `open_fds` counts them) and what each is open on."""
    targets = {}
    for fd in _own_fds():
        with contextlib.suppress(OSError):  # closed meanwhile
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return targets


def open_pipes() -> int:
    """The pipes among this process's descriptors (what background workers use)."""
    return sum(target.startswith("pipe:") for target in fd_targets().values())


def children() -> list[Any]:
    """This process's live child processes (what must be gone after close)."""
    return multiprocessing.active_children()
