"""A transform that counts its calls, for tests of how much a stage re-reads."""

from __future__ import annotations

from typing import Any


class Counter:
    """A transform that counts its calls: put it upstream to count items re-read."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, item: Any) -> Any:
        self.calls += 1
        return item
