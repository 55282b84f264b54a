"""Elastic resume: the state of one rank of a new number of ranks, computed from the
states that every rank of the old number saved (`distributed.gather_state`).

A pipeline is elastic when its rank-dependent part is a `ShardedIterator`, possibly
under `MapIterator` stages (whose state is only their source's) and an
`EqualLengthIterator`: the shards' entries of all old ranks are pooled and each new
rank takes those it owns, so every shard goes on from exactly where it stopped, on
exactly one rank. Any other stage above the `ShardedIterator` (or a pipeline without
one) keeps a rank's own position or buffers, which cannot be split or merged: the
restore is refused, naming the stage and why. Each stage declares this itself
(`Stage._not_elastic`, its reason; `Stage._source_field`, where its state holds its
source's; `Stage._regrouped`, its part of the new state), so that a new stage needs no
entry here.

An `EqualLengthIterator` on a new number of ranks starts counting afresh: its counts
are zero, its phase is ``"running"`` (``"ended"`` if the old pass had ended), and the
shards of an old rank that was padding are ended (its real items were all delivered;
what its source held was the padding's repeat). The new ranks agree again, step by
step, on when the pass ends.
"""

from __future__ import annotations

from typing import Any

from .._core.protocol import CheckpointableIterator, State
from .._core.regroup import NOT_ELASTIC, Pooling, Regroup, describe
from .._core.stage import Stage
from .sharded import ShardedIterator


def why_not_elastic(stage: str) -> str:
    """Why a stage named `stage` cannot sit above the `ShardedIterator` of an elastic
    pipeline (the reason `restore_state` gives when it refuses; see `Stage._not_elastic`)."""
    cls = stage_class(stage)
    return NOT_ELASTIC if cls is None else cls._not_elastic or NOT_ELASTIC


def stage_class(name: str) -> type[Stage[Any]] | None:
    """The stage class named `name` (as states tag it), or None if there is none: the
    first found, depth first, among the subclasses of `Stage` (the library's own come
    first, as they are defined first)."""
    pending: list[type] = [Stage]
    while pending:
        cls = pending.pop(0)
        if cls.__name__ == name and issubclass(cls, Stage):
            return cls
        pending[:0] = cls.__subclasses__()
    return None


def elastic_state(
    iterator: CheckpointableIterator[Any], states: list[Any], rank: int, world_size: int
) -> State:
    """The state with which `iterator` (rank `rank` of `world_size`) continues the pass
    whose ranks saved `states` (one per old rank, as gathered).

    Raises:
        ValueError: naming the stage, if the pipeline is not elastic (see the module), or
            if the old states do not hold every shard exactly once.
    """

    def refuse(stage: str, why: str) -> ValueError:
        return ValueError(
            f"restore_state: the checkpoint holds the data states of {len(states)} ranks, "
            f"but this job has {world_size}, and {stage} cannot be elastic "
            f"({why}); build the rank-dependent part of the pipeline as a "
            "ShardedIterator, with per-shard batching, shuffling and mixing inside its "
            f"factory, or relaunch with {len(states)} ranks"
        )

    stage: Any = iterator
    while isinstance(stage, Stage) and stage._not_elastic is None and stage._source_field:
        stage = stage.source
    if not isinstance(stage, ShardedIterator):
        why = stage._not_elastic if isinstance(stage, Stage) else None
        raise refuse(type(stage).__name__, why or NOT_ELASTIC)
    pooling = Pooling("restore_state", "rank", refuse, stage.num_shards)
    return redistributed_state(states, rank, world_size, pooling)


def redistributed_state(states: list[Any], rank: int, world_size: int, pooling: Pooling) -> State:
    """The state of rank `rank` of `world_size` of a pipeline whose old ranks (or
    readers) saved `states`, read from the states alone (their stage tags): each stage
    class regroups its own part (`Stage._regrouped`)."""
    regroup = Regroup(pooling, rank, world_size, (False,) * len(states), _regrouped)
    return _regrouped(states, regroup)


def _regrouped(states: list[Any], regroup: Regroup) -> State:
    stage = _stage_of(states, regroup.pooling)
    cls = stage_class(stage)
    if cls is None:
        raise regroup.pooling.refuse(stage, NOT_ELASTIC)
    return cls._regrouped(states, regroup)


def _stage_of(states: list[Any], pooling: Pooling) -> str:
    stages = [state.get("stage") if isinstance(state, dict) else None for state in states]
    if not states or not isinstance(stages[0], str) or len(set(stages)) > 1:
        raise ValueError(
            f"{pooling.owner}: expected one state per {pooling.unit}, all of the same stage, "
            f"got {[describe(state) for state in states]}"
        )
    return stages[0]
