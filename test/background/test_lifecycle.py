"""The consumer's wait loop: results, interrupts, a worker gone and its last words."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest

from infinibatch_like.background.lifecycle import (
    cancel_interrupt,
    interrupt,
    queue_get,
    wait_for,
)


class Attempts:
    """An `attempt` for `wait_for` giving `results` in turn, recording its timeouts."""

    def __init__(self, *results: Any) -> None:
        self.results, self.timeouts = list(results), []

    def __call__(self, timeout: float) -> Any:
        self.timeouts.append(timeout)
        return self.results.pop(0)


def test_wait_for_returns_the_first_result_that_came() -> None:
    attempts = Attempts(None, None, "done", "later")
    assert wait_for(attempts, lambda: True, last_words_s=5.0, poll_s=0.01) == "done"
    assert attempts.timeouts == [0.01, 0.01, 0.01]


@pytest.mark.parametrize("last_words", ["last", None])
def test_wait_for_gives_what_a_gone_worker_left(last_words: str | None) -> None:
    attempts = Attempts(None, last_words)
    assert wait_for(attempts, lambda: False, last_words_s=0.5, poll_s=0.01) == last_words
    assert attempts.timeouts == [0.01, 0.5]


def test_wait_for_raises_a_pending_interrupt_between_attempts_only() -> None:
    me = threading.get_ident()
    interrupt(me, KeyboardInterrupt("stalled"))
    try:
        assert wait_for(Attempts("ready"), lambda: True) == "ready"  # not waiting: no raise
        with pytest.raises(KeyboardInterrupt, match="stalled"):
            wait_for(Attempts(None, "too late"), lambda: True, poll_s=0.01)
        assert not cancel_interrupt(me)  # raised once
    finally:
        cancel_interrupt(me)


def test_queue_get_waits_up_to_its_timeout() -> None:
    entries: queue.Queue[int] = queue.Queue()
    assert queue_get(entries, 0.0) is None
    threading.Timer(0.05, entries.put, (7,)).start()
    assert wait_for(lambda timeout: queue_get(entries, timeout), lambda: True, poll_s=0.01) == 7
