"""Sharded pipelines: a fixed number of virtual shards, each an independent stream whose
state moves with it, interleaved in a fixed order, run in this process or in workers.

The unit of state is the shard: ``{"shard", "source", "replay", "delivered", "ended"}``
(the shard pipeline's state at a snapshot, items of the shard consumed since, items of
the shard delivered so far, whether it has ended). A rank's checkpoint is a list of such
entries; `infinibatch_like.distributed.elastic` redistributes them over another number of ranks, and
the same entries restore with any number of worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_callable, require_checkpointable, require_int
from .._core.fingerprint import described
from .._core.graph import Place, walk
from .._core.protocol import CheckpointableIterator, State
from .._core.regroup import Regroup
from .._core.schema import FieldSpec, Int, ListOf, Record
from .._core.stage import Stage, fast_iterator, skip_items, source_state
from ..background.lifecycle import get_context
from ..background.stage import BackgroundStage
from ..stages.prefetch import PrefetchIterator
from ..stages.sources import check_rank
from ..stages.weighted import WeightedMultiplexIterator, checked_weights
from .ranks import rank_and_world_size

T = TypeVar("T")

ShardFactory = Callable[[int, int], CheckpointableIterator[T]]
"""Builds the pipeline of shard `shard` of `num_shards`: ``factory(shard, num_shards)``
(generic in the item type, so that a lambda factory's parameters need no annotations)."""

_ENTRY = Record(
    {
        "shard": int,
        "source": (dict, type(None)),
        "replay": Int(0, lambda stage: stage._max_replay, name="snapshot_every"),
        "delivered": Int(0),
        "ended": bool,
    }
)
"""A shard entry (see the module); its replay at most the stage's `snapshot_every`."""
_FIELDS: dict[str, FieldSpec] = {"shards": ListOf(_ENTRY), "next": int}


def owned_shards(num_shards: int, rank: int, world_size: int) -> list[int]:
    """The shards that rank `rank` of `world_size` reads: ``s % world_size == rank``."""
    return list(range(rank, num_shards, world_size))


def next_live(shards: list[int], ended: list[bool], index: int) -> int:
    """The shard visited after ``shards[index]`` in round-robin order, skipping ended ones
    (-1 if every shard has ended)."""
    count = len(shards)
    for step in range(1, count + 1):
        candidate = (index + step) % count
        if not ended[candidate]:
            return shards[candidate]
    return -1


class _ShardGroup(Stage[tuple[int, bool, Any]]):
    """Round-robin over some shards' pipelines, yielding ``(shard, ended, item)``: each
    shard's items, and ``(shard, True, None)`` once when that shard ends. What a worker of
    `ShardedIterator` runs.

    Checkpoint:
        ``{"shards": [entry, ...], "next"}``: one entry per shard (see the module; its
        replay is always 0: a restore skips the replayed items at once) and the shard
        visited next (-1 once all ended).
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = _FIELDS
    _replica_sources = True  # copies of one pipeline (statistics add them up)

    def __init__(
        self, factory: ShardFactory[Any], shards: list[int], num_shards: int, max_replay: int
    ) -> None:
        self._shards = list(shards)
        self._num_shards = num_shards
        self._max_replay = max_replay
        self._pipelines = [factory(shard, num_shards) for shard in self._shards]
        for shard, pipeline in zip(self._shards, self._pipelines, strict=True):
            require_checkpointable(
                "ShardedIterator", f"factory({shard}, {num_shards})'s result", pipeline
            )
        self._sources = tuple(self._pipelines)
        self._restore(None)

    def _state(self) -> State:
        entries = [
            {
                "shard": shard,
                "source": None if self._ended[index] else source_state(self._pipelines[index]),
                "replay": 0,
                "delivered": self._delivered[index],
                "ended": self._ended[index],
            }
            for index, shard in enumerate(self._shards)
        ]
        return {"shards": entries, "next": self._next}

    def _restore(self, state: State | None) -> None:
        count = len(self._shards)
        self._delivered = [0] * count
        self._ended = [False] * count
        self._next = self._shards[0] if self._shards else -1
        if state is None:
            self.restore_sources(self._pipelines, None, "shards")
        else:
            entries = state["shards"]
            if [entry["shard"] for entry in entries] != self._shards:
                raise self.mismatch(
                    f"the state holds shards {[entry['shard'] for entry in entries]}, this "
                    f"group runs {self._shards}"
                )
            if state["next"] not in (*self._shards, -1):
                raise self.mismatch(f"'next' must be one of {self._shards}, got {state['next']}")
            self._next = state["next"]
            for index, entry in enumerate(entries):
                self._restore_shard(index, entry)
        self._iterator = self._generate()

    def _restore_shard(self, index: int, entry: State) -> None:
        self._delivered[index] = entry["delivered"]
        self._ended[index] = entry["ended"]
        pipeline = self._pipelines[index]
        if entry["ended"]:
            self.restore_source(pipeline, None)
            return
        if entry["source"] is None:
            raise self.mismatch(f"shard {entry['shard']} has not ended but has no state")
        self.restore_source(pipeline, entry["source"])
        if entry["replay"]:
            skip_items(
                fast_iterator(pipeline), entry["replay"], self._name, f"shard {entry['shard']}"
            )

    def _generate(self) -> Iterator[tuple[int, bool, Any]]:
        shards, count = self._shards, len(self._shards)
        pulls = [fast_iterator(pipeline) for pipeline in self._pipelines]
        ended, delivered = self._ended, self._delivered
        index = shards.index(self._next) if self._next != -1 else 0
        live = count - sum(ended)
        while live:
            if not ended[index]:
                try:
                    item = next(pulls[index])
                except StopIteration:
                    ended[index] = True
                    live -= 1
                    self._next = next_live(shards, ended, index)
                    yield (shards[index], True, None)
                    continue
                delivered[index] += 1
                self._next = next_live(shards, ended, index)
                yield (shards[index], False, item)
            index = (index + 1) % count
        self._next = -1


class ShardedIterator(Stage[T]):
    """Items of `num_shards` independent shard pipelines, interleaved round-robin; the
    shards are split over ranks (and over worker processes), and a checkpoint moves with
    the shards, so that it restores on another number of ranks or workers.

    ``factory(shard, num_shards)`` builds the whole pipeline of one shard (e.g. its chunks
    read, shuffled with a seed derived from the shard, tokenized and batched); it must be
    deterministic. Split the chunks by item count rather than by stride, so that shards
    (and ranks) get as many items: ``index.shards(num_shards)[shard]`` for a
    `ChunkIndex`, `infinibatch_like.prepare.balancing.balanced_shards` for ``(chunk, count)``
    pairs (compute the split once, outside the factory, for a long chunk list). This rank
    runs the shards ``s`` with ``s % world_size == rank`` and yields their items
    round-robin in shard order (a shard that ended is skipped; the stream ends when all
    have ended). With ``workers=k``, the shards run in `k` worker processes (shard number
    ``i`` of this rank in worker ``i % k``), each a `PrefetchIterator` over its shards:
    only the shard pipelines' outputs (e.g. finished batches) cross the process boundary,
    and the interleave is the same as with ``workers=0`` (everything in this process).
    `set_weights` changes the mixture of every shard's `WeightedMultiplexIterator` exactly,
    with or without workers.

    Args:
        factory: ``factory(shard, num_shards)`` -> the shard's CheckpointableIterator.
        num_shards: the number of virtual shards (fixed for the whole training: pick a
            multiple of every world size you expect, e.g. 64).
        rank: this rank (default, with `world_size`:
            `infinibatch_like.distributed.ranks.rank_and_world_size`).
        world_size: the number of ranks.
        workers: worker processes (0: run the shards in this process).
        start_method: the workers' multiprocessing start method (None: the default).
        buffer_size: items each worker keeps ready.
        snapshot_every: each worker snapshots its shards every `snapshot_every` items;
            this bounds what a restore replays per shard.

    Raises:
        TypeError, ValueError: for bad arguments, naming them.

    Checkpoint:
        ``{"shards": [entry, ...], "next"}``: one entry per shard of this rank (see the
        module: the shard pipeline's state, a replay of at most `snapshot_every` items
        with workers, 0 without, items delivered, ended) and the next shard to visit.
        Size: the sum of the shards' states. A restore restores every shard of this rank
        (re-reading what each shard's own restore re-reads, plus its replay); with workers
        the shards are restored in this process too (what `PrefetchIterator` does). The
        state does not depend on `workers`: restore it with any number of workers.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = _FIELDS
    _not_elastic = None  # the stage whose shards elastic restore pools
    _pending: list[State | None]  # per shard: its restored entry, until the shard moves on

    def __init__(
        self,
        factory: ShardFactory[T],
        num_shards: int,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        workers: int = 0,
        start_method: str | None = None,
        buffer_size: int = 8,
        snapshot_every: int = 100,
    ) -> None:
        require_callable("ShardedIterator", "factory", factory)
        require_int("ShardedIterator", "num_shards", num_shards, 1)
        require_int("ShardedIterator", "workers", workers, 0)
        require_int("ShardedIterator", "buffer_size", buffer_size, 1)
        require_int("ShardedIterator", "snapshot_every", snapshot_every, 1)
        if rank is None and world_size is None:
            rank, world_size = rank_and_world_size()
        if rank is None or world_size is None:
            raise ValueError("ShardedIterator: pass rank and world_size together, or neither")
        check_rank("ShardedIterator", world_size, rank)
        if workers:
            get_context("ShardedIterator", start_method)
        self.rank, self.world_size, self.num_shards = rank, world_size, num_shards
        self._factory = factory
        self._owned = owned_shards(num_shards, rank, world_size)
        self._max_replay = snapshot_every
        self._groups: list[_ShardGroup] = []
        self._feeds: list[Stage[tuple[int, bool, Any]]] = []
        count = max(1, min(workers, len(self._owned)))  # no idle worker
        for worker in range(count):
            group = _ShardGroup(factory, self._owned[worker::count], num_shards, snapshot_every)
            self._groups.append(group)
            self._feeds.append(
                PrefetchIterator(
                    group,
                    buffer_size,
                    mode="process",
                    start_method=start_method,
                    snapshot_every=snapshot_every,
                )
                if workers
                else group
            )
        self._sources = tuple(self._feeds)
        self._restore(None)

    @property
    def shards(self) -> list[int]:
        """The shards this rank reads, in interleave order."""
        return list(self._owned)

    @property
    def delivered(self) -> dict[int, int]:
        """Items delivered so far by each shard of this rank (counted across restores)."""
        return dict(zip(self._owned, self._delivered, strict=True))

    def _arguments(self) -> State:
        return {"num_shards": self.num_shards, "factory": described(self._factory)}

    def set_weights(self, weights: Sequence[float]) -> None:
        """Mix every shard of this rank by `weights` from the next item each shard's mixer
        draws (a curriculum): `WeightedMultiplexIterator.set_weights` on the one mixer of
        each shard's pipeline.

        Without workers the change reaches the mixers at once. With workers, the shards'
        pipelines run ahead of delivery in the worker processes, so the change restores
        this rank's shards in this process at the items delivered so far (re-reading what
        a restore re-reads, twice), changes their weights there and restarts the workers
        from that state: the stream is the one without workers, and checkpoints stay
        exact. Change weights every few thousand items, not every item.

        Raises:
            ValueError: if a shard's pipeline holds no `WeightedMultiplexIterator`, more
                than one, or one below a background stage (which runs it ahead of
                delivery), naming the shard; for bad weights, as the mixer's.
        """
        mixers = [
            _mixer_of(pipeline, shard)
            for group in self._groups
            for shard, pipeline in zip(group._shards, group._pipelines, strict=True)
        ]
        for mixer in mixers:  # all valid before any changes
            checked_weights("ShardedIterator.set_weights", weights, len(mixer.sources))
        workers = self._feeds[0] is not self._groups[0]
        if workers:  # restore the shards here, at the items delivered so far
            self.setstate(self.getstate())
        for mixer in mixers:
            mixer.set_weights(weights)
        if not workers:  # the shards run here: their states now hold the new weights
            self._pending = [None] * len(self._owned)
            return
        entries = {e["shard"]: e for group in self._groups for e in group.getstate()["shards"]}
        state = self.getstate()
        state["shards"] = [entries[shard] for shard in self._owned]
        self.setstate(state)  # the workers start from the shards changed here

    @classmethod
    def _regrouped(cls, states: list[Any], regroup: Regroup) -> State:
        """This rank's state on a new number of ranks: the entries of the shards it owns,
        pooled from every old rank's (those of a finished old rank ended)."""
        pooling, unit = regroup.pooling, regroup.pooling.unit
        entries: dict[int, Any] = {}
        fingerprint = None
        for old, (old_state, done) in enumerate(zip(states, regroup.finished, strict=True)):
            shards = regroup.field(old_state, cls.__name__, "shards")
            fingerprint = old_state.get("fingerprint", fingerprint)
            if not isinstance(shards, list):
                raise regroup.error(f"{unit} {old}'s 'shards' is not a list")
            for entry in shards:
                shard = entry.get("shard") if isinstance(entry, dict) else None
                if not isinstance(shard, int) or shard in entries:
                    raise regroup.error(
                        f"{unit} {old}'s ShardedIterator state holds shard {shard!r} "
                        f"{'twice' if shard in entries else 'as a bad entry'}"
                    )
                if done:  # what its source holds now is padding, not the pass
                    entry = {**entry, "source": None, "replay": 0, "ended": True}
                entries[shard] = entry
        num_shards = len(entries) if pooling.num_shards is None else pooling.num_shards
        if sorted(entries) != list(range(num_shards)):
            raise regroup.error(
                f"the {unit}s' ShardedIterator states hold shards {sorted(entries)}, "
                + (
                    f"this pipeline has {num_shards} shards (num_shards cannot change)"
                    if pooling.num_shards is not None
                    else f"but not every shard from 0 to {max(entries, default=0)}: give the "
                    f"states of every old {unit}"
                )
            )
        if pooling.check_shards is not None:
            pooling.check_shards(num_shards)
        owned = owned_shards(num_shards, regroup.rank, regroup.world_size)
        merged: State = {
            "stage": cls.__name__,
            "shards": [entries[shard] for shard in owned],
            "next": next((s for s in owned if entries[s].get("ended") is not True), -1),
        }
        if fingerprint is not None:
            merged["fingerprint"] = fingerprint
        return merged

    def _worker_of(self, index: int) -> int:
        return index % len(self._feeds)

    def _state(self) -> State:
        entries: dict[int, State] = {}
        for feed, group in zip(self._feeds, self._groups, strict=True):
            feed_state = source_state(feed)
            group_state = feed_state if feed is group else feed_state[str(feed._source_field)]
            for entry in group_state["shards"]:
                entries[entry["shard"]] = entry
        result = []
        for index, shard in enumerate(self._owned):
            pending = self._pending[index]
            if pending is not None:
                result.append(pending)
                continue
            entry = entries[shard]
            since = self._delivered[index] - entry["delivered"]
            ended = self._ended[index]
            result.append(
                {
                    "shard": shard,
                    "source": None if ended else entry["source"],
                    "replay": 0 if ended else entry["replay"] + since,
                    "delivered": self._delivered[index],
                    "ended": ended,
                }
            )
        return {"shards": result, "next": self._next}

    def _restore(self, state: State | None) -> None:
        count = len(self._owned)
        self._delivered = [0] * count
        self._ended = [False] * count
        self._pending = [None] * count
        self._next = self._owned[0] if self._owned else -1
        if state is None:
            self.restore_sources(self._feeds, None, "workers")
        else:
            self._restore_entries(state)
        self._iterator = self._generate()

    def _restore_entries(self, state: State) -> None:
        entries = state["shards"]
        shards = [entry["shard"] for entry in entries]
        if shards != self._owned:
            raise self.mismatch(
                f"the state holds shards {shards}, but rank {self.rank} of {self.world_size} "
                f"reads {self._owned}; to resume on another number of ranks, restore a "
                "gather_state() checkpoint with infinibatch_like.distributed.restore_state"
            )
        if state["next"] not in (*self._owned, -1):
            raise self.mismatch(f"'next' must be one of {self._owned} or -1, got {state['next']}")
        self._next = state["next"]
        self._delivered = [entry["delivered"] for entry in entries]
        self._ended = [entry["ended"] for entry in entries]
        self._pending = list(entries)  # reported as restored until the shard moves on
        start = self._owned.index(self._next) if self._next != -1 else 0
        for worker, (feed, group) in enumerate(zip(self._feeds, self._groups, strict=True)):
            indices = [i for i in range(len(self._owned)) if self._worker_of(i) == worker]
            local = [entries[i] for i in indices]
            after = [i for i in indices if i >= start] + [i for i in indices if i < start]
            live = [i for i in after if not entries[i]["ended"]]
            group_state: State = {
                "stage": "_ShardGroup",
                "shards": local,
                "next": self._owned[live[0]] if live else -1,
            }
            if feed is not group:  # the worker's PrefetchIterator, at the group's state
                group_state = feed._state_around(group_state)
            self.restore_source(feed, group_state)

    def _generate(self) -> Iterator[T]:
        owned, count = self._owned, len(self._owned)
        pulls = [fast_iterator(feed) for feed in self._feeds]
        worker_of = [self._worker_of(index) for index in range(count)]
        workers = [pulls[worker] for worker in worker_of]
        ended, delivered = self._ended, self._delivered
        for worker in sorted({worker_of[i] for i in range(count) if not ended[i]}):
            feed = self._feeds[worker]
            if isinstance(feed, BackgroundStage):  # all at once: each reads its first block
                feed.start()  # while the others do, not after the first item of the one before
        index = owned.index(self._next) if self._next != -1 else 0
        live = count - sum(ended)
        while live:
            if not ended[index]:
                shard, shard_ended, item = next(workers[index])
                if shard != owned[index]:
                    raise RuntimeError(
                        f"ShardedIterator: expected an item of shard {owned[index]} from its "
                        f"worker, got one of shard {shard}"
                    )
                if shard_ended:
                    ended[index] = True
                    live -= 1
                else:
                    delivered[index] += 1
                self._pending[index] = None
                self._next = next_live(owned, ended, index)
                if not shard_ended:
                    yield item
                elif not any(
                    not ended[i] for i in range(count) if self._worker_of(i) == worker_of[index]
                ):
                    next(workers[index], None)  # the worker's end: it stops
            index = (index + 1) % count
        self._next = -1


def _mixer_of(pipeline: CheckpointableIterator[Any], shard: int) -> WeightedMultiplexIterator[Any]:
    """The one `WeightedMultiplexIterator` of a shard's pipeline, not below a background
    stage; else a ValueError naming the shard."""
    found: list[tuple[WeightedMultiplexIterator[Any], str | None]] = []
    for place in walk(pipeline, _not_a_mixer):
        if isinstance(place.stage, WeightedMultiplexIterator):
            below = [up.stage for up in place.above() if isinstance(up.stage, BackgroundStage)]
            found.append((place.stage, type(below[-1]).__name__ if below else None))
    if len(found) != 1:
        raise ValueError(
            f"ShardedIterator.set_weights: shard {shard}'s pipeline holds {len(found)} "
            "WeightedMultiplexIterators, expected exactly one"
        )
    mixer, background = found[0]
    if background is not None:
        raise ValueError(
            f"ShardedIterator.set_weights: shard {shard}'s WeightedMultiplexIterator runs "
            f"below a {background}, ahead of delivery, where a change of weights cannot take "
            "effect at an exact item; put the background stage below the mixer"
        )
    return mixer


def _not_a_mixer(place: Place) -> bool:
    """Whether `_mixer_of` looks into the sources of the stage at `place`."""
    return not isinstance(place.stage, WeightedMultiplexIterator)
