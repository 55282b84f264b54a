"""Waiting in tests for what another thread or process does, without timing assertions."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], seconds: float = 20.0) -> bool:
    """Whether `condition()` comes true within `seconds` (polled every 5 ms).

    For a state that another thread or process reaches and that no event announces; the
    limit only ends a test that would otherwise hang, so it is generous (a loaded machine
    may be slow, never this slow)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
