"""Mixing several sources by weight: a seeded random draw or a low-discrepancy schedule."""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from fractions import Fraction
from itertools import accumulate
from typing import Any, ClassVar, TypeVar, cast

from .._core.checks import require_checkpointable
from .._core.protocol import CheckpointableIterator, State
from .._core.rng import (
    MARK_FIELDS,
    CountingRandom,
    Mark,
    Seed,
    adopt_seed,
    mark_fields,
    read_mark,
    resolve_seed,
)
from .._core.schema import Field, FieldSpec, Int, ListOf, Real, SchemaError
from .._core.stage import Stage, fast_iterator, source_state

T = TypeVar("T")

_STOP_ON = ("all_exhausted", "first_exhausted")
_log = logging.getLogger("infinibatch_like")


def checked_weights(owner: str, weights: object, count: int) -> list[float]:
    """`weights` as floats, one per source, finite, >= 0 and not all zero; else ValueError."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise ValueError(f"{owner}: weights must be a sequence of {count} numbers, got {weights!r}")
    if len(weights) != count:
        raise ValueError(
            f"{owner}: weights must hold one weight per source ({count}), got {len(weights)}: "
            f"{list(weights)!r}"
        )
    try:
        for index, weight in enumerate(weights):
            _WEIGHT.check(weight, f"weights[{index}]", None)
    except SchemaError as error:
        raise ValueError(f"{owner}: {error.path} {error.problem}") from None
    values = [float(weight) for weight in weights]
    if not any(values):
        raise ValueError(f"{owner}: weights must not all be zero, got {list(weights)!r}")
    return values


_WEIGHT = Real(0.0)


def _per_source(stage: Any) -> int:
    return len(stage._choices)


class _Weights(Field):
    """A state's weights: one per source of the stage, not all zero."""

    def check(self, value: object, path: str, owner: Any) -> None:
        ListOf(_WEIGHT, _per_source, "source").check(value, path, owner)
        if not any(cast("list[float]", value)):
            raise SchemaError(path, f"must not all be zero, got {value!r}")


def _as_integers(weights: list[float]) -> list[int]:
    """Integers in exactly the ratios of the float `weights` (their denominators are 2**k)."""
    exact = [Fraction(weight) for weight in weights]
    scale = max(fraction.denominator for fraction in exact)
    return [fraction.numerator * (scale // fraction.denominator) for fraction in exact]


class WeightedMultiplexIterator(Stage[T]):
    """Interleaves items of several sources, each item's source chosen by weight.

    With ``exact=False`` each item's source is drawn at random, source i with probability
    ``weights[i] / sum(weights)`` (exactly: the draw is ``randrange`` over integers in the
    weights' ratios, from one ``random.Random(seed)``). With ``exact=True`` the order is a
    fixed low-discrepancy schedule (Tijdeman's earliest-deadline rule): with k sources of
    positive weight, after n items source i has given ``c_i`` items with
    ``|c_i - n * w_i / sum(w)| <= 1 - 1 / (2k - 2)`` (< 1; exactly n * w_i / sum(w) for
    k = 1); ties go to the lower index. Either way the same arguments give the same
    order on every rank and every run, so ranks mix alike.

    `set_weights` changes the mixture from the next item on (curricula). A source that ends
    is dropped and the others share its weight (``stop_on="all_exhausted"``; the stream
    ends when every source of positive weight has ended), or the stream ends with it
    (``stop_on="first_exhausted"``). A source of weight 0 is never read. The exact
    schedule's bound holds from the last change (a `set_weights` call or a dropped
    source) on: there it starts again with the counts at zero.

    Args:
        source_iterators: the sources (not reset).
        weights: one finite weight >= 0 per source, not all zero (ints or floats; kept as
            floats).
        seed: seed of the random draws; None draws one (kept in checkpoints). Unused with
            ``exact=True``.
        exact: use the deterministic schedule instead of random draws.
        stop_on: ``"all_exhausted"`` (default) or ``"first_exhausted"``.

    Raises:
        ValueError: for no sources, a source that is not checkpointable, a bad `stop_on`,
            or bad weights (wrong count, not numbers, negative, NaN or infinite, all zero).

    Changing the weights at a restart: a state restored into an iterator constructed
    with other `weights` than the checkpointed run's constructor takes the new weights
    from the restore point on (a curriculum's next phase), with a log message (logger
    ``infinibatch_like``); if the constructor's weights are the same, the weights of the
    checkpointed run (including `set_weights` changes) continue. `exact` and `stop_on`
    decide the stream and cannot change at a restart.

    Checkpoint:
        ``{"sources", "weights", "initial_weights", "seed", "draws", "generator",
        "counts", "active", "ended", "fingerprint"}``: the sources' states, the current
        and the constructor's weights, the generator's position (see
        `infinibatch_like._core.rng`; 0 with ``exact=True``), the items taken from each source
        since the last change, which sources have not ended, whether the stream has ended,
        and `exact` and `stop_on`. Constant size besides the sources' states; a restore
        redraws at most 2**24 words at C speed and re-reads nothing.
    """

    _not_elastic = "its schedule belongs to this rank's sources"
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "sources": list,
        "weights": _Weights(),
        "initial_weights": _Weights(),
        "seed": (int, str),
        **MARK_FIELDS,
        "counts": ListOf(Int(0), _per_source, "source"),
        "active": ListOf(bool, _per_source, "source"),
        "ended": bool,
    }

    def __init__(
        self,
        source_iterators: Sequence[CheckpointableIterator[T]],
        weights: Sequence[float],
        seed: Seed | None = 0,
        *,
        exact: bool = False,
        stop_on: str = "all_exhausted",
    ) -> None:
        if not source_iterators:
            raise ValueError(f"{self._name}: source_iterators must not be empty")
        for index, source in enumerate(source_iterators):
            require_checkpointable(self._name, f"source_iterators[{index}]", source)
        if stop_on not in _STOP_ON:
            raise ValueError(f"{self._name}: stop_on must be one of {_STOP_ON}, got {stop_on!r}")
        self._choices = tuple(source_iterators)
        self._sources = self._choices
        self._initial = checked_weights(self._name, weights, len(self._choices))
        self._seed, self._seed_drawn = resolve_seed(self._name, seed)
        self._exact = bool(exact)
        self._stop_first = stop_on == "first_exhausted"
        self._restore(None)

    def _arguments(self) -> State:
        return {"exact": self._exact, "stop_on": _STOP_ON[self._stop_first]}

    @property
    def weights(self) -> list[float]:
        """The current weights (a copy)."""
        return list(self._weights)

    def set_weights(self, weights: Sequence[float]) -> None:
        """Mix by `weights` from the next item on; validated like the constructor's.

        The change is part of the state: a restore continues with these weights. Sources
        that have ended stay dropped.
        """
        self._weights = checked_weights(f"{self._name}.set_weights", weights, len(self._choices))
        self._counts = [0] * len(self._choices)
        self._plan()

    def _state(self) -> State:
        return {
            "sources": self._source_states(),
            "weights": list(self._weights),
            "initial_weights": list(self._initial),
            "seed": self._seed,
            **mark_fields(self._rng.mark()),
            "counts": list(self._counts),
            "active": list(self._active),
            "ended": self._ended,
        }

    def _source_states(self) -> list[State]:
        """The sources' states for a checkpoint (a subclass reading ahead records its own)."""
        return [source_state(source) for source in self._choices]

    def _restore(self, state: State | None) -> None:
        count = len(self._choices)
        self.restore_sources(self._choices, None if state is None else state["sources"], "sources")
        mark: Mark = (0, None)
        if state is None:
            self._weights = list(self._initial)
            self._counts, self._active, self._ended = [0] * count, [True] * count, False
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            weights = [float(weight) for weight in state["weights"]]
            initial = [float(weight) for weight in state["initial_weights"]]
            counts, active = state["counts"], state["active"]
            mark = read_mark(self, state["draws"], state["generator"])
            self._counts, self._active, self._ended = list(counts), list(active), state["ended"]
            self._weights = weights
            if initial != self._initial:
                _log.info(
                    "%s: the checkpoint's run was constructed with weights %s, this one with "
                    "%s: mixing by %s from the restore point on",
                    self._name,
                    initial,
                    self._initial,
                    self._initial,
                )
                self._weights, self._counts = list(self._initial), [0] * count
        self._rng = CountingRandom.from_mark(self._seed, mark)
        self._plan()
        self._iterator = self._generate()

    def _plan(self) -> None:
        """Index the sources that can be chosen now, with their integer weights."""
        integers = _as_integers(self._weights)
        self._live = [
            (index, weight)
            for index, weight in enumerate(integers)
            if weight > 0 and self._active[index]
        ]
        self._bounds = list(accumulate(weight for _, weight in self._live))
        self._spread = max(2 * len(self._live) - 2, 1)

    def _generate(self) -> Iterator[T]:
        pulls = [fast_iterator(source) for source in self._choices]
        choose = self._scheduled if self._exact else self._drawn
        while not self._ended:
            if not self._live:
                self._ended = True
                return
            index = choose()
            try:
                item = next(pulls[index])
            except StopIteration:
                self._drop(index)
                continue
            self._counts[index] += 1
            yield item

    def _drop(self, index: int) -> None:
        """Source `index` has ended: drop it (`stop_on`) and start the counts again."""
        self._active[index] = False
        self._ended = self._stop_first
        self._counts = [0] * len(self._choices)
        self._plan()

    def _drawn(self) -> int:
        """A source drawn at random in proportion to the weights of the live sources."""
        total = self._bounds[-1]
        bits = total.bit_length()
        draw = self._rng.getrandbits  # counts every 32-bit word, also for totals >= 2**32
        ticket = draw(bits)
        while ticket >= total:
            ticket = draw(bits)
        return self._live[bisect_right(self._bounds, ticket)][0]

    def _scheduled(self) -> int:
        """The next source of the exact schedule.

        With weights p_i (summing to 1) over k live sources and d = 1 / (2k - 2), the m-th
        item of source i is due in the window of item numbers ``[(m - 1 + d) / p_i,
        (m - d) / p_i]``; the rule takes, among the sources whose window has opened, the
        one whose window closes first. Some window is always open (if none were,
        ``sum(c_i) > n - k * d >= n - 1``, but the counts sum to n - 1). Integer weights
        W_i with total S keep every comparison exact.
        """
        counts, spread, total = self._counts, self._spread, self._bounds[-1]
        number = sum(counts[index] for index, _ in self._live) + 1
        best, best_due, best_weight = -1, 0, 1
        for index, weight in self._live:
            taken = counts[index]
            if spread * weight * number >= total * (spread * taken + 1):
                due = spread * (taken + 1) - 1
                if best < 0 or due * best_weight < best_due * weight:
                    best, best_due, best_weight = index, due, weight
        return best
