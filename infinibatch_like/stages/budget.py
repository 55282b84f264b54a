"""Token-budget mixing: weights that count tokens (or any per-item cost), not items."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._core.checks import require_callable
from .._core.fingerprint import described
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import Seed
from .weighted import WeightedMultiplexIterator

T = TypeVar("T")


class TokenBudgetMultiplexIterator(WeightedMultiplexIterator[T]):
    """Interleaves items of several sources so that each source's share of the total
    *cost* (by default ``len(item)``: tokens) follows the weights.

    With ``exact=True`` (the default) the order is a fixed schedule: the next item comes
    from the source whose cost so far, divided by its weight, is the smallest (the lower
    index among equals), so that after any item each source's cost differs from its
    target share of the total by less than the largest cost of one of its items. With
    ``exact=False`` the next source is drawn at random in proportion to the weights among
    the sources not ahead of their share, which keeps the same bound. Costs are counted
    when an item is taken, so they are exact whatever the item lengths; the same arguments
    give the same order on every rank and every run.

    Everything else is `WeightedMultiplexIterator`'s: `set_weights` for curricula (from the
    next item; the costs start again at zero), sources of weight 0 never read, ended
    sources dropped (``stop_on``), weights changeable at a restart, and use inside
    `ShardedIterator` (whose ``set_weights`` reaches this mixer too).

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
        since the last change, plus ``"cost"`` in the fingerprint. Constant size besides
        the sources' states (O(number of sources)); a restore re-reads nothing.
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
        self._item_cost = self._checked_cost
        super().__init__(source_iterators, weights, seed, exact=exact, stop_on=stop_on)

    def _arguments(self) -> State:
        return {**super()._arguments(), "cost": described(self._cost)}

    def _checked_cost(self, item: Any) -> int:
        value = self._cost(item)
        if type(value) is not int or value < 0:
            raise (TypeError if type(value) is not int else ValueError)(
                f"{self._name}: cost must return an int >= 0, got {value!r}"
            )
        return value

    def _behind(self) -> list[tuple[int, int]]:
        """The live sources (index, integer weight) whose cost is not ahead of their share."""
        counts, total = self._counts, self._bounds[-1]
        spent = sum(counts[index] for index, _ in self._live)
        return [(i, weight) for i, weight in self._live if counts[i] * total <= weight * spent]

    def _scheduled(self) -> int:
        counts = self._counts
        best, best_count, best_weight = -1, 0, 1
        for index, weight in self._live:
            count = counts[index]
            if best < 0 or count * best_weight < best_count * weight:
                best, best_count, best_weight = index, count, weight
        return best

    def _drawn(self) -> int:
        candidates = self._behind()
        total = sum(weight for _, weight in candidates)
        bits = total.bit_length()
        ticket = self._rng.getrandbits(bits)
        while ticket >= total:
            ticket = self._rng.getrandbits(bits)
        for index, weight in candidates:
            if ticket < weight:
                return index
            ticket -= weight
        raise AssertionError("unreachable: the tickets cover the candidates' weights")
