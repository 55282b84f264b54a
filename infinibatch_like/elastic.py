"""Elastic resume: the state of one rank of a new number of ranks, computed from the
states that every rank of the old number saved (`distributed.gather_state`).

A pipeline is elastic when its rank-dependent part is a `ShardedIterator`, possibly
under `MapIterator` stages (whose state is only their source's): the shards' entries of
all old ranks are pooled and each new rank takes those it owns, so every shard goes on
from exactly where it stopped, on exactly one rank. Any other stage above the
`ShardedIterator` (or a pipeline without one) keeps a rank's own position or buffers,
which cannot be split or merged: the restore is refused, naming the stage and why.
"""

from __future__ import annotations

from typing import Any

from ._base import CheckpointableIterator, State
from .mapping import MapIterator
from .sharded import ShardedIterator

_WHY = {
    "BucketedReadaheadBatchIterator": "its read-ahead holds this rank's items",
    "FixedBatchIterator": "a batch in progress holds this rank's items",
    "BlockwiseShuffleIterator": "its block holds this rank's items",
    "BufferedShuffleIterator": "its buffer holds this rank's items",
    "WeightedMultiplexIterator": "its schedule belongs to this rank's sources",
    "MultiplexIterator": "its position belongs to this rank's sources",
    "EqualLengthIterator": "its counts and padding phase belong to this rank",
    "ParallelMapIterator": "its replay counts items of this rank's stream",
    "PrefetchIterator": "its replay counts items of this rank's stream",
    "SelectManyIterator": "it reads this rank's chunks, not shards",
    "InfinitePermutationSourceIterator": "it reads this rank's share of the chunks",
    "ChunkedSourceIterator": "it reads this rank's share of the chunks",
}


def elastic_state(
    iterator: CheckpointableIterator[Any], states: list[Any], rank: int, world_size: int
) -> State:
    """The state with which `iterator` (rank `rank` of `world_size`) continues the pass
    whose ranks saved `states` (one per old rank, as gathered).

    Raises:
        ValueError: naming the stage, if the pipeline is not elastic (see the module), or
            if the old states do not hold every shard exactly once.
    """
    if isinstance(iterator, MapIterator):
        inner = [_field(state, "MapIterator", "source") for state in states]
        outer = dict(states[rank % len(states)])
        outer["source"] = elastic_state(iterator._source, inner, rank, world_size)
        return outer
    if isinstance(iterator, ShardedIterator):
        return _redistributed(iterator, states)
    name = type(iterator).__name__
    why = _WHY.get(name, "it is not a ShardedIterator (or a MapIterator over one)")
    raise ValueError(
        f"restore_state: the checkpoint holds the data states of {len(states)} ranks, but "
        f"this job has {world_size}, and {name} cannot be elastic ({why}); build the "
        "rank-dependent part of the pipeline as a ShardedIterator, with per-shard batching, "
        "shuffling and mixing inside its factory, or relaunch with "
        f"{len(states)} ranks"
    )


def _field(state: Any, stage: str, key: str) -> Any:
    if not isinstance(state, dict) or state.get("stage") != stage or key not in state:
        raise ValueError(
            f"restore_state: expected every rank's state to be one of {stage} with {key!r}, "
            f"got {_describe(state)}"
        )
    return state[key]


def _describe(state: Any) -> str:
    if isinstance(state, dict):
        return f"a state of {state.get('stage')!r}"
    return type(state).__name__


def _redistributed(iterator: ShardedIterator[Any], states: list[Any]) -> State:
    """This rank's `ShardedIterator` state: the entries of its shards, from every rank."""
    entries: dict[int, Any] = {}
    fingerprint = None
    for old_rank, old_state in enumerate(states):
        shards = _field(old_state, "ShardedIterator", "shards")
        fingerprint = old_state.get("fingerprint", fingerprint)
        if not isinstance(shards, list):
            raise ValueError(f"restore_state: rank {old_rank}'s 'shards' is not a list")
        for entry in shards:
            shard = entry.get("shard") if isinstance(entry, dict) else None
            if not isinstance(shard, int) or shard in entries:
                raise ValueError(
                    f"restore_state: rank {old_rank}'s ShardedIterator state holds shard "
                    f"{shard!r} {'twice' if shard in entries else 'as a bad entry'}"
                )
            entries[shard] = entry
    if sorted(entries) != list(range(iterator.num_shards)):
        raise ValueError(
            f"restore_state: the ranks' ShardedIterator states hold shards {sorted(entries)}, "
            f"this pipeline has {iterator.num_shards} shards (num_shards cannot change)"
        )
    owned = iterator.shards
    merged: State = {
        "stage": "ShardedIterator",
        "shards": [entries[shard] for shard in owned],
        "next": next((s for s in owned if not entries[s]["ended"]), -1),
    }
    if fingerprint is not None:
        merged["fingerprint"] = fingerprint
    return merged
