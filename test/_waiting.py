"""Waiting in tests for what another thread or process does, without timing assertions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


HANG = 30.0
"""Seconds after which a step that must end "at once" (rather than after a timeout of
minutes, or never) counts as hanging: far beyond what it takes on a loaded runner."""


def within(seconds: float, action: Callable[[], T]) -> T:
    """`action()` run in a thread: its value or its exception; fails the test (instead of
    hanging) if it takes longer than `seconds`."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, action()))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"did not finish within {seconds} s"
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value  # type: ignore[no-any-return]
