"""The public checker catches each way a user's own iterator can break the checkpoint
contract (keys, aliased states, closed positions, hangs, errors, arguments), naming the rule."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like._core.stage import Stage
from infinibatch_like.testing import ContractViolation, assert_checkpointable

HANGING = threading.Event()
"""Released at the end of each test: the "hang" flaw's restores wait for it (they must not
keep running, or spinning, after the checker gave up on them)."""


@pytest.fixture(autouse=True)
def release_hanging_restores() -> Iterator[None]:
    HANGING.clear()
    yield
    HANGING.set()


class Counter(it.CheckpointableIterator[int]):
    """Yields 0 .. n - 1; `flaw` names one way to break the contract (None: none)."""

    def __init__(self, n: int, flaw: str | None = None) -> None:
        self._n, self._flaw = n, flaw
        self._closed = False
        self._last: tuple[int, dict[str, Any]] = (-1, {})
        self.setstate(None)

    def __next__(self) -> int:
        if self._closed:
            raise RuntimeError("Counter is closed")
        if self._next >= self._n:
            raise StopIteration
        self._next += 1
        return self._next - 1

    def getstate(self) -> dict[str, Any]:
        if self._closed and self._flaw == "closed position":
            return {"stage": "Counter", "next": self._n, "n": self._n}
        if self._flaw == "aliasing" and self._last[0] == self._next:
            return self._last[1]  # the dict returned before, which the caller may have changed
        self._last = (self._next, {"stage": "Counter", "next": self._next, "n": self._n})
        return self._last[1]

    def setstate(self, checkpoint: dict[str, Any] | None) -> None:
        if checkpoint is None:
            self._next = 0
            return
        if not isinstance(checkpoint, dict) or checkpoint.get("stage") != "Counter":
            raise ValueError(f"Counter: not a Counter state: {checkpoint!r}")
        if self._flaw == "strict keys" and set(checkpoint) != {"stage", "next", "n"}:
            raise ValueError(f"Counter: unexpected keys in {sorted(checkpoint)}")
        if "next" not in checkpoint or "n" not in checkpoint:
            raise ValueError(f"Counter: 'next' or 'n' missing in {checkpoint!r}")
        position, n = checkpoint["next"], checkpoint["n"]
        if self._flaw != "any arguments" and n != self._n:
            raise ValueError(f"Counter: the state was taken with n={n!r}, this one has {self._n}")
        if self._flaw == "deep error":
            self._next = position
            return
        if self._flaw == "hang" and type(position) is int and position > self._n:
            HANGING.wait()  # as if it skipped `position` items, for ever
        if type(position) is not int or not 0 <= position <= self._n:
            raise ValueError(f"Counter: 'next' must be in [0, {self._n}], got {position!r}")
        self._next = position

    def close(self) -> None:
        self._closed = True


def test_a_sound_iterator_passes() -> None:
    assert_checkpointable(lambda: Counter(12), different=lambda: Counter(13))
    assert_checkpointable(lambda: it.MapIterator(Counter(12), str))


@pytest.mark.parametrize(
    ("flaw", "rule"),
    [
        ("strict keys", "C4"),
        ("aliasing", "C9"),
        ("closed position", "C8"),
        ("hang", "C11"),
        ("deep error", "C11"),
        ("any arguments", "C10"),
    ],
)
def test_each_flaw_is_caught_naming_its_rule(flaw: str, rule: str) -> None:
    with pytest.raises(ContractViolation, match=f"^{rule}:"):
        assert_checkpointable(
            lambda: Counter(12, flaw),
            different=lambda: Counter(13, flaw),
            deadline=0.5,
            check_pickle=False,
        )


def test_an_outer_stage_that_ignores_an_inner_restore_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the marking of consumers, an outer stage keeps reading the old stream.
    monkeypatch.setattr(Stage, "_desync_consumers", lambda self: None)
    with pytest.raises(ContractViolation, match=r"^inner restore:"):
        assert_checkpointable(
            lambda: it.MapIterator(it.NativeCheckpointableIterator(list(range(30))), str)
        )
