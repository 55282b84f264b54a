"""Ranks simulated on threads: a group whose `reduce` is an element-wise max over all
ranks, and a runner of one thread per rank."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class ThreadGroup:
    """Ranks on threads: `reduce` is an element-wise max over all ranks (a barrier)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[list[int]] = [[] for _ in range(size)]
        self.barrier = threading.Barrier(size, timeout=10)

    def reduce(self, rank: int, flags: list[int]) -> list[int]:
        self.slots[rank] = flags
        self.barrier.wait()
        result = [max(values) for values in zip(*self.slots, strict=True)]
        self.barrier.wait()
        return result


class Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank


def run_ranks(work: Callable[[int], Any], size: int) -> list[Any]:
    """`work(rank)` on one thread per rank; each result, or the exception raised."""
    results: list[Any] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a simulated rank hangs"
    return results
