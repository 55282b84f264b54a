"""What elastic restore (`infinibatch_like.distributed.elastic`) gives the stages that
can be elastic: the old states are regrouped stage by stage, from the outermost one down
to the stage that pools the shards, each stage class computing its own part of the new
state (`Stage._regrouped`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .protocol import State

NOT_ELASTIC = "it is not a ShardedIterator, or a MapIterator over one"
"""Why a stage that declares nothing cannot be elastic."""


@dataclass(frozen=True)
class Pooling:
    """How a regrouping names things in its errors, and what it checks.

    Attributes:
        owner: the public function, named first in every message.
        unit: what one old state belongs to (``"rank"``, ``"reader"``).
        refuse: the error for a stage that cannot be elastic, given the stage's name and
            why (the stage's declared reason).
        num_shards: the new pipeline's number of shards, when known (else the pooled
            shards must be ``0 .. n-1``).
        check_shards: called with the number of pooled shards once they are checked,
            before they are split: raises if the new job cannot use them.
    """

    owner: str
    unit: str
    refuse: Callable[[str, str], ValueError]
    num_shards: int | None = None
    check_shards: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Regroup:
    """One step of a regrouping: the state of new rank `rank` of `world_size`, from the
    states of one stage that the old ranks (or readers) saved.

    Attributes:
        pooling: the names and checks of the whole regrouping.
        rank: the new rank.
        world_size: the new number of ranks.
        finished: per old state, whether it was past its real items (its shards ended;
            what they hold now is padding).
        inner: regroups the states of the stage below (given them and the next step).
    """

    pooling: Pooling
    rank: int
    world_size: int
    finished: tuple[bool, ...]
    inner: Callable[[list[Any], Regroup], State]

    def error(self, problem: str) -> ValueError:
        """A ValueError naming the regrouping's owner."""
        return ValueError(f"{self.pooling.owner}: {problem}")

    def field(self, state: Any, stage: str, key: str) -> Any:
        """``state[key]``, if `state` is one of `stage` holding `key`; else an error."""
        if not isinstance(state, dict) or state.get("stage") != stage or key not in state:
            raise self.error(
                f"expected every {self.pooling.unit}'s state to be one of {stage} with "
                f"{key!r}, got {describe(state)}"
            )
        return state[key]

    def around(
        self, stage: str, key: str, states: list[Any], finished: list[bool] | None = None
    ) -> State:
        """The state of a stage whose own fields are the same on every rank, around its
        source's (in field `key`): this rank's old one (modulo their number), with the
        sources' states regrouped (`finished`: updated flags for the step below)."""
        inner = [self.field(state, stage, key) for state in states]
        below = self if finished is None else replace(self, finished=tuple(finished))
        result = dict(states[self.rank % len(states)])
        result[key] = self.inner(inner, below)
        return result


def describe(state: Any) -> str:
    """A state, as errors name it: its stage, or its type."""
    if isinstance(state, dict):
        return f"a state of {state.get('stage')!r}"
    return type(state).__name__
