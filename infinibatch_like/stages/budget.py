"""Token-budget mixing: weights that count tokens (or any per-item cost), not items."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_callable
from .._core.fingerprint import described
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import Seed
from .._core.schema import FieldSpec
from .._core.stage import fast_iterator, skip_items, source_state
from .weighted import WeightedMultiplexIterator

T = TypeVar("T")
_MARK_EVERY = 64  # items read from a source between two records of its state


class TokenBudgetMultiplexIterator(WeightedMultiplexIterator[T]):
    """Interleaves items of several sources so that each source's share of the total
    *cost* (by default ``len(item)``: tokens) follows the weights.

    The mixer reads one item ahead in each source of positive weight, so that it knows
    the cost of every candidate. With ``exact=True`` (the default) the order is a fixed
    schedule: the next item comes from the source whose cost so far plus half the cost
    of its next item, divided by its weight, is the smallest (the lower index among
    equals): each item is placed so that its source's share is on target halfway
    through it, and a long item is balanced by as much of the others before as after
    it. At every item each source's cost differs from its target share of the total by
    at most ``((1 - w_i) L_i + w_i * (sum of the other L_j)) / 2``, for normalised
    weights ``w`` and ``L_i`` the largest cost of an item of source i (about a third of
    the longest item with three equal weights). With
    ``exact=False`` the next source is drawn at random in proportion to the weights among
    the sources whose cost plus half their next item's, per weight, is not above the
    average, which keeps the stream near its target too. Costs are counted exactly,
    whatever the item lengths; the same arguments give the same order on every rank and
    every run.

    Everything else is `WeightedMultiplexIterator`'s: `set_weights` for curricula (from the
    next item; the costs start again at zero), sources of weight 0 never read, ended
    sources dropped (``stop_on``: a source's end is seen when its next item is read
    ahead), weights changeable at a restart, and use inside `ShardedIterator` (whose
    ``set_weights`` reaches this mixer too).

    Args:
        source_iterators: the sources (not reset).
        weights: one finite weight >= 0 per source, not all zero: target shares of cost.
        cost: ``cost(item)`` -> an int >= 0 (default `len`: tokens of a token list).
        seed: seed of the random draws (``exact=False``); None draws one.
        exact: the deterministic schedule (default) instead of random draws.
        stop_on: ``"all_exhausted"`` (default) or ``"first_exhausted"``.

    Raises:
        ValueError: as `WeightedMultiplexIterator`; TypeError if `cost` is not callable.
        TypeError, ValueError: when `cost` returns something other than an int >= 0,
            with a note naming the stage.

    Checkpoint:
        `WeightedMultiplexIterator`'s fields, with ``"counts"`` holding each source's cost
        since the last change and ``"sources"`` each source's state at a replay point
        (recorded every 64 items read from it), plus ``"skips"``: the items of each
        source read since its replay point and yielded (not the one read ahead), and
        ``"cost"`` in the fingerprint. Constant size besides the sources' states
        (O(number of sources)); a restore re-reads at most 64 items per source.
    """

    _user_callables = ("cost",)
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        **WeightedMultiplexIterator._state_fields,
        "skips": list,
    }

    def __init__(
        self,
        source_iterators: Sequence[CheckpointableIterator[T]],
        weights: Sequence[float],
        cost: Callable[[Any], int] = len,
        seed: Seed | None = 0,
        *,
        exact: bool = True,
        stop_on: str = "all_exhausted",
    ) -> None:
        require_callable(self._name, "cost", cost)
        self._cost = cost
        super().__init__(source_iterators, weights, seed, exact=exact, stop_on=stop_on)

    def _arguments(self) -> State:
        return {**super()._arguments(), "cost": described(self._cost)}

    def _state(self) -> State:
        skips = [
            read - (ahead is not _NOTHING and ahead is not _ENDED)
            for read, ahead in zip(self._read, self._ahead, strict=True)
        ]
        return {**super()._state(), "skips": skips}

    def _source_states(self) -> list[State]:
        return [
            source_state(source) if mark is None else mark
            for source, mark in zip(self._choices, self._marks, strict=True)
        ]

    def _restore(self, state: State | None) -> None:
        count = len(self._choices)
        self._ahead: list[Any] = [_NOTHING] * count  # the item read ahead, per source
        self._ahead_cost = [0] * count
        self._marks: list[State | None] = [None] * count  # replay points: source states
        self._read = [0] * count  # items read from each source since its replay point
        skips = self._checked_skips(state["skips"]) if state is not None else self._read
        super()._restore(state)
        if state is None:
            return
        for index, (source, skip) in enumerate(zip(self._choices, skips, strict=True)):
            skip_items(fast_iterator(source), skip, self._name, f"source {index}")
        self._marks, self._read = list(state["sources"]), skips

    def _checked_skips(self, skips: Any) -> list[int]:
        if not (
            type(skips) is list
            and len(skips) == len(self._choices)
            and all(type(skip) is int and 0 <= skip <= _MARK_EVERY for skip in skips)
        ):
            raise self.mismatch(
                f"'skips' must hold {len(self._choices)} ints in [0, {_MARK_EVERY}], got {skips!r}"
            )
        return list(skips)

    def _checked_cost(self, item: Any) -> int:
        value = self._cost(item)
        if type(value) is not int or value < 0:
            raise (TypeError if type(value) is not int else ValueError)(
                f"{self._name}: cost must return an int >= 0, got {value!r}"
            )
        return value

    def _read_ahead(self, index: int) -> int:
        """Read source `index`'s next item ahead; its cost, or -1 if the source ended."""
        if self._marks[index] is None or self._read[index] >= _MARK_EVERY:
            self._marks[index] = source_state(self._choices[index])
            self._read[index] = 0
        try:
            item = next(self._pulls[index])
        except StopIteration:
            self._ahead[index], self._ahead_cost[index] = _ENDED, -1
            return -1
        self._read[index] += 1
        cost = self._ahead_cost[index] = self._checked_cost(item)
        self._ahead[index] = item
        return cost

    def _generate(self) -> Iterator[T]:
        self._pulls = [fast_iterator(source) for source in self._choices]
        choose = self._scheduled if self._exact else self._drawn
        ahead = self._ahead
        while not self._ended:
            if not self._live:
                self._ended = True
                return
            index = choose()  # reads every live source's next item ahead
            item = ahead[index]
            if item is _ENDED:
                self._drop(index)
                continue
            ahead[index] = _NOTHING
            self._counts[index] += self._ahead_cost[index]
            yield item

    def _midpoints(self) -> list[tuple[int, int, int]] | int:
        """(index, integer weight, 2 * cost so far + next item's cost) of the live sources,
        or the index of a source found to have ended."""
        ahead, upcoming, counts, found = self._ahead, self._ahead_cost, self._counts, []
        for index, weight in self._live:
            cost = upcoming[index] if ahead[index] is not _NOTHING else self._read_ahead(index)
            if cost < 0:
                return index
            found.append((index, weight, 2 * counts[index] + cost))
        return found

    def _scheduled(self) -> int:
        ahead, upcoming, counts = self._ahead, self._ahead_cost, self._counts
        best, best_mid, best_weight = -1, 0, 1
        for index, weight in self._live:  # `_midpoints` without the list, for speed
            cost = upcoming[index] if ahead[index] is not _NOTHING else self._read_ahead(index)
            if cost < 0:
                return index
            mid = 2 * counts[index] + cost
            if best < 0 or mid * best_weight < best_mid * weight:
                best, best_mid, best_weight = index, mid, weight
        return best

    def _drawn(self) -> int:
        found = self._midpoints()
        if isinstance(found, int):
            return found
        total = self._bounds[-1]
        overall = sum(mid for _, _, mid in found)
        candidates = [(i, weight) for i, weight, mid in found if mid * total <= weight * overall]
        weights = sum(weight for _, weight in candidates)
        bits = weights.bit_length()
        ticket = self._rng.getrandbits(bits)
        while ticket >= weights:
            ticket = self._rng.getrandbits(bits)
        for index, weight in candidates:
            if ticket < weight:
                return index
            ticket -= weight
        raise AssertionError("unreachable: the tickets cover the candidates' weights")


class _Marker:
    """Marks a source's read-ahead slot: nothing read ahead, or the source ended."""

    def __init__(self, name: str) -> None:
        self._text = name

    def __repr__(self) -> str:
        return self._text


_NOTHING = _Marker("<nothing read ahead>")
_ENDED = _Marker("<ended>")
