"""The public checker: the contract as a table of rules, each flaw of a user's own iterator
caught naming its rule, and exemptions that name the rule and say why."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like._core import stage as stage_module
from infinibatch_like.testing import ContractViolation, assert_checkpointable, checker
from infinibatch_like.testing.rules import RULES, Rule
from infinibatch_like.testing.trial import Trial

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
            if self._flaw == "not sticky":
                self._next = 0
            raise StopIteration
        self._next += 1
        return self._next - 1 + self._shift

    def getstate(self) -> dict[str, Any]:
        if self._closed and self._flaw == "closed position":
            return {"stage": "Counter", "next": self._n, "n": self._n}
        if self._flaw == "aliasing" and self._last[0] == self._next:
            return self._last[1]  # the dict returned before, which the caller may have changed
        if self._flaw == "getstate advances":
            self._next += 1
        state: dict[str, Any] = {"stage": "Counter", "next": self._next, "n": self._n}
        if self._flaw == "tuple":
            state["span"] = (0, self._n)
        if self._flaw == "shape" and self._next == self._n:
            state["ended"] = True
        self._last = (self._next, state)
        return state

    def __reduce__(self) -> Any:
        if self._flaw == "pickles fresh":
            return (Counter, (self._n, self._flaw))
        return super().__reduce__()

    def setstate(self, checkpoint: dict[str, Any] | None) -> None:
        self._shift = 100 if checkpoint is not None and self._flaw == "shifted restore" else 0
        if checkpoint is None:
            if self._flaw != "no reset" or not hasattr(self, "_next"):
                self._next = 0
            return
        if not isinstance(checkpoint, dict) or checkpoint.get("stage") != "Counter":
            name = "this iterator" if self._flaw == "unnamed errors" else "Counter"
            raise ValueError(f"not a state of {name}: {checkpoint!r}")
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
        ("getstate advances", "C1"),
        ("shifted restore", "C2"),
        ("no reset", "C3"),
        ("strict keys", "C4"),
        ("shape", "C5"),
        ("tuple", "C6"),
        ("not sticky", "C7"),
        ("unnamed errors", "foreign state"),
        ("pickles fresh", "pickle"),
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
            check_pickle=flaw == "pickles fresh",
        )


def test_an_outer_stage_that_ignores_an_inner_restore_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without the marking of consumers, an outer stage keeps reading the old stream.
    marking = stage_module._desync_consumers
    observers = [o for o in stage_module._RESTORE_OBSERVERS if o is not marking]
    monkeypatch.setattr(stage_module, "_RESTORE_OBSERVERS", observers)
    with pytest.raises(ContractViolation, match=r"^inner restore:"):
        assert_checkpointable(
            lambda: it.MapIterator(it.NativeCheckpointableIterator(list(range(30))), str)
        )


def test_the_table_holds_every_rule_of_the_contract_each_stated_in_one_sentence() -> None:
    ids = [rule.id for rule in RULES]
    assert sorted(ids) == sorted(
        [f"C{number}" for number in range(1, 12)] + ["foreign state", "inner restore", "pickle"]
    )
    for rule in RULES:
        assert rule.statement.endswith("."), rule.id
        assert ". " not in rule.statement, rule.id
    assert ids[-1] == "C8"  # closing last: every other pipeline of the check is closed by then


def test_the_checker_runs_every_rule_of_the_table_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []

    def recording(rule: Rule) -> Rule:
        def check(trial: Trial) -> None:
            ran.append(rule.id)
            rule.check(trial)

        return Rule(rule.id, rule.statement, check)

    monkeypatch.setattr(checker, "RULES", tuple(map(recording, RULES)))
    assert_checkpointable(lambda: Counter(12), different=lambda: Counter(13))
    assert ran == [rule.id for rule in RULES]


def test_an_exempt_rule_is_not_checked_and_the_others_still_are() -> None:
    reason = "rebuilt from its arguments when pickled"
    assert_checkpointable(lambda: Counter(12, "pickles fresh"), exempt={"pickle": reason})
    with pytest.raises(ContractViolation, match=r"^C10:"):
        assert_checkpointable(
            lambda: Counter(12, "any arguments"),
            different=lambda: Counter(13, "any arguments"),
            exempt={"pickle": reason},
        )


@pytest.mark.parametrize(
    ("exempt", "message"),
    [
        ({"C12": "no such rule"}, r"exempt names no rule \['C12'\]; the rules are \['C6', "),
        ({"pickle": " "}, "exempt\\['pickle'\\] must say why the pipeline cannot keep the rule"),
    ],
)
def test_an_exemption_must_name_a_rule_and_give_the_reason(
    exempt: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^assert_checkpointable: {message}"):
        assert_checkpointable(lambda: Counter(12), exempt=exempt)
