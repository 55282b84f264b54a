"""Token-budget mixing: weights that count tokens (or any per-item cost), not items."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ._base import CheckpointableIterator, State, require_callable, source_state
from ._fingerprint import described
from ._rng import Seed
from .weighted import WeightedMultiplexIterator

T = TypeVar("T")


class TokenBudgetMultiplexIterator(WeightedMultiplexIterator[T]):
    """Interleaves items of several sources so that each source's share of the total
    *cost* (by default ``len(item)``: tokens) follows the weights.

    The mixer reads one item ahead in each source of positive weight, so that it knows
    the cost of every candidate. With ``exact=True`` (the default) the order is a fixed
    schedule: the next item comes from the source whose cost so far plus half the cost
    of its next item, divided by its weight, is the smallest (the lower index among
    equals): each item is placed so that its source's share is on target halfway
    through it, and a long item is balanced by as much of the others before as after
    it. After any item each source's cost differs from its target share of the total by
    at most the largest cost of an item of any source (scaled by the weights). With
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
        since the last change, ``"sources"`` each source's state before the item read
        ahead (taken when that item is read: one source state per item), plus ``"cost"``
        in the fingerprint. Constant size besides the sources' states (O(number of
        sources)); a restore re-reads the items read ahead, one per source.
    """

    _user_callables = ("cost",)

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

    def _restore(self, state: State | None) -> None:
        count = len(self._choices)
        self._ahead: list[Any] = [_NOTHING] * count  # the item read ahead, per source
        self._ahead_cost = [0] * count
        self._before: list[State | None] = [None] * count  # the source's state before it
        super()._restore(state)

    def _source_states(self) -> list[State]:
        return [
            source_state(source) if before is None else before
            for source, before in zip(self._choices, self._before, strict=True)
        ]

    def _checked_cost(self, item: Any) -> int:
        value = self._cost(item)
        if type(value) is not int or value < 0:
            raise (TypeError if type(value) is not int else ValueError)(
                f"{self._name}: cost must return an int >= 0, got {value!r}"
            )
        return value

    def _next_cost(self, index: int) -> int:
        """The cost of source `index`'s next item, read ahead if not yet; -1 if it ended."""
        if self._ahead[index] is _NOTHING:
            before = source_state(self._choices[index])
            try:
                item = next(self._pulls[index])
            except StopIteration:
                self._ahead[index] = _ENDED
                return -1
            self._ahead_cost[index] = self._checked_cost(item)
            self._ahead[index], self._before[index] = item, before
        elif self._ahead[index] is _ENDED:
            return -1
        return self._ahead_cost[index]

    def _take(self, index: int) -> tuple[T, int]:
        item = self._ahead[index]
        if item is _NOTHING:  # the random draw chose it without looking ahead
            self._next_cost(index)
            item = self._ahead[index]
        if item is _ENDED:
            raise StopIteration
        self._ahead[index], self._before[index] = _NOTHING, None
        return item, self._ahead_cost[index]

    def _midpoints(self) -> list[tuple[int, int, int]] | int:
        """(index, integer weight, 2 * cost so far + next item's cost) of the live sources,
        or the index of a source found to have ended."""
        counts, found = self._counts, []
        for index, weight in self._live:
            upcoming = self._next_cost(index)
            if upcoming < 0:
                return index
            found.append((index, weight, 2 * counts[index] + upcoming))
        return found

    def _scheduled(self) -> int:
        found = self._midpoints()
        if isinstance(found, int):
            return found
        best, best_mid, best_weight = -1, 0, 1
        for index, weight, mid in found:
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
