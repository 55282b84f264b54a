"""`Stage`'s restore observers: told of every restore, direct or through a consumer, even
one that fails part way."""

from __future__ import annotations

from typing import Any

import pytest

import infinibatch_like.iterators as it
from infinibatch_like import StateMismatchError
from infinibatch_like._core import stage as stage_module
from infinibatch_like._core.stage import Stage, observe_restores


@pytest.fixture
def restores(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(stage_module, "_RESTORE_OBSERVERS", list(stage_module._RESTORE_OBSERVERS))

    def record(stage: Stage[Any], direct: bool) -> None:
        seen.append((stage._name, direct))

    observe_restores(record)
    return seen


def test_observers_hear_of_each_restore_and_whether_it_was_called_directly(
    restores: list[tuple[str, bool]],
) -> None:
    source = it.NativeCheckpointableIterator([1, 2, 3])
    pipeline = it.MapIterator(source, str)
    assert restores == []  # building a stage is not a restore
    pipeline.setstate(None)
    assert restores == [("NativeCheckpointableIterator", False), ("MapIterator", True)]
    restores.clear()
    source.setstate(None)
    assert restores == [("NativeCheckpointableIterator", True)]
    with pytest.raises(RuntimeError, match="MapIterator no longer matches its source"):
        next(pipeline)  # the marking of consumers is itself an observer


def test_observers_hear_of_a_restore_that_fails(restores: list[tuple[str, bool]]) -> None:
    pipeline = it.MapIterator(it.NativeCheckpointableIterator([1, 2, 3]), str)
    state = pipeline.getstate()
    state["source"]["stage"] = "Other"
    with pytest.raises(StateMismatchError):
        pipeline.setstate(state)
    assert restores == [("NativeCheckpointableIterator", False), ("MapIterator", True)]
