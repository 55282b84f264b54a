"""check_resume: passes exact pipelines, reports the first difference of inexact ones."""

from __future__ import annotations

from typing import Any

import pytest

from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    ChunkedSourceIterator,
    MapIterator,
    ParallelMapIterator,
    PrefetchIterator,
    SelectManyIterator,
    WeightedMultiplexIterator,
    create_source_iterator,
)
from infinibatch_like.testing import ContractViolation, ResumeMismatch, check_resume


class Phased(CheckpointableIterator[tuple[int, int]]):
    """Yields (item, phase); the phase advances every 10 items. ``exact`` decides whether
    the state records the phase (an inexact iterator forgets it: the bug to catch)."""

    def __init__(self, source: CheckpointableIterator[int], exact: bool) -> None:
        self._source, self._exact = source, exact
        self.setstate(None)

    def __next__(self) -> tuple[int, int]:
        item = next(self._source)
        self._count += 1
        if self._count % 10 == 0:
            self._phase += 1
        return item, self._phase

    def getstate(self) -> dict[str, Any]:
        state = {"source": self._source.getstate(), "count": self._count}
        return {**state, "phase": self._phase} if self._exact else state

    def setstate(self, checkpoint: dict[str, Any] | None) -> None:
        self._source.setstate(checkpoint["source"] if checkpoint else None)
        self._count = checkpoint["count"] if checkpoint else 0
        self._phase = checkpoint.get("phase", 0) if checkpoint else 0

    def close(self) -> None:
        self._source.close()


class TupleSensitive(CheckpointableIterator[int]):
    """Counts up; its state holds a tuple, and a restore from a list (what JSON gives back)
    silently starts over: exact in memory, inexact after a JSON round trip."""

    def __init__(self) -> None:
        self._position = 0

    def __next__(self) -> int:
        self._position += 1
        return self._position

    def getstate(self) -> dict[str, Any]:
        return {"position": (self._position,)}

    def setstate(self, checkpoint: dict[str, Any] | None) -> None:
        position = checkpoint["position"] if checkpoint else (0,)
        self._position = position[0] if isinstance(position, tuple) else 0

    def close(self) -> None:
        pass


class Limited(TupleSensitive):
    """Ends once its position reaches ``_limit`` (None: never)."""

    _limit: int | None = None

    def __next__(self) -> int:
        if self._limit is not None and self._position >= self._limit:
            raise StopIteration
        return super().__next__()


def test_passes_an_exact_custom_iterator() -> None:
    check_resume(lambda: Phased(ChunkedSourceIterator(list(range(100))), exact=True))


def test_catches_an_iterator_whose_state_misses_a_field() -> None:
    with pytest.raises(ResumeMismatch) as caught:
        check_resume(lambda: Phased(ChunkedSourceIterator(list(range(100))), exact=False))
    error = caught.value
    assert isinstance(error, ContractViolation)
    # 8 points over 100 items: the first is 0 (exact), the second 12 (phase 1 forgotten)
    assert (error.restore_point, error.round_trip, error.index) == (12, "original", 12)
    assert (error.expected, error.got) == ((12, 1), (12, 0))
    message = str(error)
    assert "restored from the original state saved at item 12" in message
    assert "at item 12: expected (12, 1), got (12, 0)" in message
    assert "expected from item 12: [(12, 1), (13, 1)" in message


def test_catches_a_state_that_breaks_in_a_json_round_trip() -> None:
    with pytest.raises(ResumeMismatch, match="JSON round-tripped state saved at item 3") as caught:
        check_resume(TupleSensitive, max_items=30, restore_points=[3, 20])
    assert caught.value.index == 3
    assert (caught.value.expected, caught.value.got) == (4, 1)


def test_reports_a_restore_that_raises() -> None:
    class Refusing(TupleSensitive):
        def setstate(self, checkpoint: dict[str, Any] | None) -> None:
            if checkpoint is not None and not isinstance(checkpoint["position"], tuple):
                raise ValueError("Refusing: position must be a tuple")
            super().setstate(checkpoint)

    with pytest.raises(
        ResumeMismatch,
        match="restoring the JSON round-tripped state saved at "
        "item 5 raised ValueError: Refusing: position must be a tuple",
    ) as caught:
        check_resume(Refusing, max_items=10, restore_points=[5])
    assert caught.value.index is None


def test_catches_a_stream_that_goes_on_after_its_end() -> None:
    class Endless(Limited):
        """Ends after 20 items, except after a restore."""

        _limit = 20

        def setstate(self, checkpoint: dict[str, Any] | None) -> None:
            super().setstate(checkpoint)
            self._limit = None

    with pytest.raises(
        ResumeMismatch, match="yielded 21 where the uninterrupted run ended"
    ) as caught:
        check_resume(Endless, restore_points=[10], check_torch=False)
    assert caught.value.index == 20


def test_chained_resumes_catch_an_error_that_compounds() -> None:
    class Once(Phased):
        """The state of a restored pipeline forgets the phase it was restored with."""

        def setstate(self, checkpoint: dict[str, Any] | None) -> None:
            super().setstate(checkpoint)
            self._base = checkpoint["phase"] if checkpoint else 0

        def getstate(self) -> dict[str, Any]:
            state = super().getstate()
            return {**state, "phase": state["phase"] - self._base}

    with pytest.raises(ResumeMismatch) as caught:
        check_resume(lambda: Once(ChunkedSourceIterator(list(range(60))), exact=True))
    assert caught.value.round_trip == "chained"


def test_passes_a_full_background_pipeline() -> None:
    def chunk(name: str) -> list[str]:
        return [f"{name}{index}" * (1 + index % 5) for index in range(7)]

    def dataset(prefix: str, seed: int) -> Any:
        chunks = create_source_iterator([f"{prefix}{c}-" for c in range(6)], seed=seed)
        return SelectManyIterator(chunks, chunk, read_ahead=2)

    def factory() -> Any:
        mixed = WeightedMultiplexIterator([dataset("a", 1), dataset("b", 2)], [2.0, 1.0], seed=3)
        prefetched = PrefetchIterator(mixed, 16, mode="thread", snapshot_every=5)
        mapped = ParallelMapIterator(prefetched, str.upper, 2, 3, mode="thread", snapshot_every=4)
        return MapIterator(BucketedReadaheadBatchIterator(mapped, 12, len, 3, seed=4), tuple)

    check_resume(factory, max_items=40, restore_points=5)


def test_catches_a_stream_that_ends_early_after_a_restore() -> None:
    class Short(Limited):
        """Counts up without end, but a restored one stops 5 items later."""

        def setstate(self, checkpoint: dict[str, Any] | None) -> None:
            super().setstate(checkpoint)
            self._limit = None if checkpoint is None else self._position + 5

    with pytest.raises(ResumeMismatch, match="at item 15: ended after 5 items, expected 16"):
        check_resume(Short, max_items=30, restore_points=[10], check_torch=False)
