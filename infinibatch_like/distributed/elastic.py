"""Elastic resume: the state of one rank of a new number of ranks, computed from the
states that every rank of the old number saved (`distributed.gather_state`).

A pipeline is elastic when its rank-dependent part is a `ShardedIterator`, possibly
under `MapIterator` stages (whose state is only their source's) and an
`EqualLengthIterator`: the shards' entries of all old ranks are pooled and each new
rank takes those it owns, so every shard goes on from exactly where it stopped, on
exactly one rank. Any other stage above the `ShardedIterator` (or a pipeline without
one) keeps a rank's own position or buffers, which cannot be split or merged: the
restore is refused, naming the stage and why.

An `EqualLengthIterator` on a new number of ranks starts counting afresh: its counts
are zero, its phase is ``"running"`` (``"ended"`` if the old pass had ended), and the
shards of an old rank that was padding are ended (its real items were all delivered;
what its source held was the padding's repeat). The new ranks agree again, step by
step, on when the pass ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core.graph import Place, walk
from .._core.protocol import GATHERED_FORMAT, CheckpointableIterator, State
from ..stages.mapping import MapIterator
from .equal_length import EqualLengthIterator
from .ranks import group_rank_and_size
from .sharded import ShardedIterator, owned_shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_WHY = {
    "BucketedReadaheadBatchIterator": "its read-ahead holds this rank's items",
    "FixedBatchIterator": "a batch in progress holds this rank's items",
    "BlockwiseShuffleIterator": "its block holds this rank's items",
    "BufferedShuffleIterator": "its buffer holds this rank's items",
    "WeightedMultiplexIterator": "its schedule belongs to this rank's sources",
    "TokenBudgetMultiplexIterator": "its schedule belongs to this rank's sources",
    "PackingIterator": "its open sequences hold this rank's documents",
    "MultiplexIterator": "its position belongs to this rank's sources",
    "ParallelMapIterator": "its replay counts items of this rank's stream",
    "PrefetchIterator": "its replay counts items of this rank's stream",
    "SelectManyIterator": "it reads this rank's chunks, not shards",
    "InfinitePermutationSourceIterator": "it reads this rank's share of the chunks",
    "ChunkedSourceIterator": "it reads this rank's share of the chunks",
}
_PASS_THROUGH = (MapIterator, EqualLengthIterator)  # stages elastic above a ShardedIterator


def _passes_through(place: Place) -> bool:
    return isinstance(place.stage, _PASS_THROUGH)


def why_not_elastic(stage: str) -> str:
    """Why a stage named `stage` cannot sit above the `ShardedIterator` of an elastic
    pipeline (the reason `restore_state` gives when it refuses)."""
    return _WHY.get(stage, "it is not a ShardedIterator, or a MapIterator over one")


@dataclass(frozen=True)
class Pooling:
    """How `redistributed_state` names things in its errors, and what it checks.

    Attributes:
        owner: the public function, named first in every message.
        unit: what one old state belongs to (``"rank"``, ``"reader"``).
        refuse: the error for a stage that cannot be elastic (given the stage's name).
        num_shards: the new pipeline's number of shards, when known (else the pooled
            shards must be ``0 .. n-1``).
        check_shards: called with the number of pooled shards once they are checked,
            before they are split: raises if the new job cannot use them.
    """

    owner: str
    unit: str
    refuse: Callable[[str], ValueError]
    num_shards: int | None = None
    check_shards: Callable[[int], None] | None = None


def elastic_state(
    iterator: CheckpointableIterator[Any], states: list[Any], rank: int, world_size: int
) -> State:
    """The state with which `iterator` (rank `rank` of `world_size`) continues the pass
    whose ranks saved `states` (one per old rank, as gathered).

    Raises:
        ValueError: naming the stage, if the pipeline is not elastic (see the module), or
            if the old states do not hold every shard exactly once.
    """

    def refuse(stage: str) -> ValueError:
        return ValueError(
            f"restore_state: the checkpoint holds the data states of {len(states)} ranks, "
            f"but this job has {world_size}, and {stage} cannot be elastic "
            f"({why_not_elastic(stage)}); build the rank-dependent part of the pipeline as a "
            "ShardedIterator, with per-shard batching, shuffling and mixing inside its "
            f"factory, or relaunch with {len(states)} ranks"
        )

    stage = next(  # the first stage below the pass-through ones
        place.stage for place in walk(iterator, _passes_through) if not _passes_through(place)
    )
    if not isinstance(stage, ShardedIterator):
        raise refuse(type(stage).__name__)
    pooling = Pooling("restore_state", "rank", refuse, stage.num_shards)
    return redistributed_state(states, rank, world_size, pooling)


def redistributed_state(states: list[Any], rank: int, world_size: int, pooling: Pooling) -> State:
    """The state of rank `rank` of `world_size` of a pipeline whose old ranks (or
    readers) saved `states`, read from the states alone (their stage tags)."""
    return _redistributed(states, rank, world_size, pooling, [False] * len(states))


def _redistributed(
    states: list[Any], rank: int, world_size: int, pooling: Pooling, finished: list[bool]
) -> State:
    """`finished[i]`: the old state `i` was past its real items (its shards all ended)."""
    stage = _stage_of(states, pooling)
    if stage == "ShardedIterator":
        return _sharded(states, rank, world_size, pooling, finished)
    if stage not in ("MapIterator", "EqualLengthIterator"):
        raise pooling.refuse(stage)
    inner = [_field(state, stage, "source", pooling) for state in states]
    result = dict(states[rank % len(states)])
    if stage == "EqualLengthIterator":
        phases = [_field(state, stage, "phase", pooling) for state in states]
        ended = [phase == "ended" for phase in phases]
        if any(ended) and not all(ended):
            raise ValueError(
                f"{pooling.owner}: the {pooling.unit}s' EqualLengthIterator states are of "
                f"different steps (phases {phases}): every {pooling.unit} ends the pass at "
                "the same step"
            )
        pairs = zip(finished, phases, strict=True)
        finished = [done or phase != "running" for done, phase in pairs]
        result.update(phase="ended" if all(ended) else "running", real=0, padded=0, dropped=0)
    result["source"] = _redistributed(inner, rank, world_size, pooling, finished)
    return result


def _stage_of(states: list[Any], pooling: Pooling) -> str:
    stages = [state.get("stage") if isinstance(state, dict) else None for state in states]
    if not states or not isinstance(stages[0], str) or len(set(stages)) > 1:
        raise ValueError(
            f"{pooling.owner}: expected one state per {pooling.unit}, all of the same stage, "
            f"got {[_describe(state) for state in states]}"
        )
    return stages[0]


def _field(state: Any, stage: str, key: str, pooling: Pooling) -> Any:
    if not isinstance(state, dict) or state.get("stage") != stage or key not in state:
        raise ValueError(
            f"{pooling.owner}: expected every {pooling.unit}'s state to be one of {stage} "
            f"with {key!r}, got {_describe(state)}"
        )
    return state[key]


def _describe(state: Any) -> str:
    if isinstance(state, dict):
        return f"a state of {state.get('stage')!r}"
    return type(state).__name__


def _sharded(
    states: list[Any], rank: int, world_size: int, pooling: Pooling, finished: list[bool]
) -> State:
    """This rank's `ShardedIterator` state: the entries of its shards, from every old one."""
    entries: dict[int, Any] = {}
    fingerprint = None
    for old, (old_state, done) in enumerate(zip(states, finished, strict=True)):
        shards = _field(old_state, "ShardedIterator", "shards", pooling)
        fingerprint = old_state.get("fingerprint", fingerprint)
        if not isinstance(shards, list):
            raise ValueError(f"{pooling.owner}: {pooling.unit} {old}'s 'shards' is not a list")
        for entry in shards:
            shard = entry.get("shard") if isinstance(entry, dict) else None
            if not isinstance(shard, int) or shard in entries:
                raise ValueError(
                    f"{pooling.owner}: {pooling.unit} {old}'s ShardedIterator state holds "
                    f"shard {shard!r} {'twice' if shard in entries else 'as a bad entry'}"
                )
            if done:  # what its source holds now is padding, not the pass
                entry = {**entry, "source": None, "replay": 0, "ended": True}
            entries[shard] = entry
    num_shards = len(entries) if pooling.num_shards is None else pooling.num_shards
    if sorted(entries) != list(range(num_shards)):
        raise ValueError(
            f"{pooling.owner}: the {pooling.unit}s' ShardedIterator states hold shards "
            f"{sorted(entries)}, "
            + (
                f"this pipeline has {num_shards} shards (num_shards cannot change)"
                if pooling.num_shards is not None
                else f"but not every shard from 0 to {max(entries, default=0)}: give the "
                f"states of every old {pooling.unit}"
            )
        )
    if pooling.check_shards is not None:
        pooling.check_shards(num_shards)
    owned = owned_shards(num_shards, rank, world_size)
    merged: State = {
        "stage": "ShardedIterator",
        "shards": [entries[shard] for shard in owned],
        "next": next((s for s in owned if entries[s].get("ended") is not True), -1),
    }
    if fingerprint is not None:
        merged["fingerprint"] = fingerprint
    return merged


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
