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

from typing import TYPE_CHECKING, Any

from .._core.graph import Place, walk
from .._core.protocol import GATHERED_FORMAT, CheckpointableIterator, State
from .._core.regroup import NOT_ELASTIC, Pooling, Regroup, describe
from .._core.stage import Stage
from .ranks import group_rank_and_size
from .sharded import ShardedIterator

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _passes_through(place: Place) -> bool:
    """Whether the stage at `place` may sit above the `ShardedIterator` (as it declares)."""
    stage = place.stage
    return isinstance(stage, Stage) and stage._not_elastic is None and bool(stage._source_field)


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

    stage = next(  # the first stage below the pass-through ones
        place.stage for place in walk(iterator, _passes_through) if not _passes_through(place)
    )
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


def restore_state(
    iterator: CheckpointableIterator[Any],
    state: dict[str, Any],
    group: ProcessGroup | None = None,
) -> None:
    """Restore `iterator` on this rank from a `gather_state` result (a local call).

    Each rank takes the state of its own rank in `group` (default: the whole job). Every
    rank must restore from the same gathered dict. On another number of ranks, a pipeline
    built on a `ShardedIterator` (under MapIterator stages and an EqualLengthIterator
    only) takes the entries of the shards it now owns from every old rank's state
    (`elastic_state`): every shard continues exactly where it stopped, on exactly one rank.

    Raises:
        ValueError: if `state` is not a `gather_state` result, or was gathered on another
            number of ranks and the pipeline is not elastic (naming the stage and why).
        StateMismatchError: (a ValueError) if this rank's state does not fit `iterator`.
    """
    if not isinstance(state, dict):
        raise ValueError(
            f"restore_state: expected a dict made by gather_state, got {type(state).__name__}"
        )
    if state.get("format") != GATHERED_FORMAT:
        raise ValueError(
            "restore_state: expected a dict made by gather_state (with 'format': "
            f"{GATHERED_FORMAT!r}), got one with keys {sorted(state)}; a state from "
            "iterator.getstate() is restored with iterator.setstate()"
        )
    saved_size, states = state.get("world_size"), state.get("ranks")
    if not (
        type(saved_size) is int and isinstance(states, list) and len(states) == saved_size >= 1
    ):
        raise ValueError(
            "restore_state: the gathered state is corrupt: expected 'world_size' >= 1 and as "
            f"many 'ranks' states, got world_size={saved_size!r} and "
            f"{len(states) if isinstance(states, list) else type(states).__name__} states"
        )
    rank, world_size = group_rank_and_size("restore_state", group)
    if world_size != saved_size:
        iterator.setstate(elastic_state(iterator, states, rank, world_size))
        return
    iterator.setstate(states[rank])
