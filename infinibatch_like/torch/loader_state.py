"""`resize_loader_state`: a `StatefulDataLoader` checkpoint for another number of
DataLoader workers (and ranks), made from the checkpoints of every old rank.

torchdata 0.11's `StatefulDataLoader` cannot load a state of another number of workers:
``_StatefulMultiProcessingDataLoaderIter._restore_main_state`` asserts
``self._num_workers == state_dict["_main_snapshot"]["_num_workers"]`` (a bare
AssertionError), a state of ``num_workers=0`` lacks the ``"_snapshot"`` that a loader
with workers asserts, and one with workers lacks the ``"_num_yielded"`` that a loader
without workers asserts. Each worker's dataset state is one reader's pipeline state, so
the loader could not split or merge them anyway. This module does it: when every
reader's pipeline is a `ShardedIterator` (possibly under `MapIterator` stages), the
readers' shard entries are pooled and each new reader takes the shards it owns
(`infinibatch_like.distributed.elastic`), and a loader state of the new shape is written
around them.
"""

from __future__ import annotations

import copy
from typing import Any

from .._core.checks import require_int
from .._core.protocol import State, StateMismatchError
from .._core.regroup import Pooling
from ..distributed.elastic import redistributed_state
from .dataset import KIND, checked_state, reader_identity

# The keys of torchdata 0.11's StatefulDataLoader states.
_SNAPSHOT = "_snapshot"
_MAIN = "_main_snapshot"
_WORKERS = "_worker_snapshots"
_STEP = "_snapshot_step"
_SINCE = "_steps_since_snapshot"
_LAST_WORKER = "_last_yielded_worker_id"
_NUM_WORKERS = "_num_workers"
_BASE_SEED = "_base_seed"
_NUM_YIELDED = "_num_yielded"
_FINISHED = "_iterator_finished"
_SAMPLER_KEYS = (  # the main process's fields, kept as they were
    "_index_sampler_state",
    "_sampler_iter_state",
    "_sampler_iter_yielded",
    "_IterableDataset_len_called",
    "_shared_seed",
)
_OWNER = "resize_loader_state"


def resize_loader_state(
    states: dict[str, Any] | list[dict[str, Any]],
    *,
    num_workers: int,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The `StatefulDataLoader` state with which rank `rank` of `world_size`, reading a
    `CheckpointableDataset` with `num_workers` workers, continues where the old loaders
    stopped, whatever their numbers of workers and ranks were.

    Every reader's pipeline (``factory(instance_rank, num_instances)`` of the dataset)
    must be elastic: a `ShardedIterator` over the readers, e.g.
    ``functools.partial(ShardedIterator, shard_factory, num_shards)``, possibly under
    `MapIterator` stages. Over a finite pass, every item is then delivered exactly once
    over all readers, before and after the change; the workers' items interleave in the
    new loader's round-robin, starting with worker 0. Load the result with
    ``loader.load_state_dict(...)`` into a loader with exactly `num_workers` workers.

    Args:
        states: the ``loader.state_dict()`` of every rank of the old job, in rank order
            (one dict for a job of one rank), each from a `CheckpointableDataset`.
        num_workers: the new loader's ``num_workers`` (0: read in the main process).
        rank: the new rank (with `world_size`, as the new dataset's).
        world_size: the new number of ranks.

    Returns:
        A loader state (plain data). With the same numbers of ranks and workers, a copy
        of ``states[rank]``.

    Raises:
        TypeError, ValueError: for bad arguments or states, naming the rank, the worker
            and the field; if a state was taken between two snapshots (a loader with
            ``snapshot_every_n_steps > 1`` and workers knows its workers' positions only
            at snapshots); if the readers' states do not hold every shard exactly once;
            or if a reader's pipeline is not elastic (naming the stage and why); if the
            new job has more readers (``world_size * max(num_workers, 1)``) than the
            states hold shards, since a reader beyond the shards would read nothing.
    """
    old = [states] if isinstance(states, dict) else states
    if not isinstance(old, list) or not old or not all(isinstance(s, dict) for s in old):
        raise TypeError(
            f"{_OWNER}: states must be a loader state dict or a non-empty list of them (one "
            f"per old rank), got {_summary(states)}"
        )
    require_int(_OWNER, "num_workers", num_workers, 0)
    require_int(_OWNER, "world_size", world_size, 1)
    require_int(_OWNER, "rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"{_OWNER}: need rank < world_size, got rank={rank}, {world_size=}")
    if len(old) == world_size and _workers_of(old[rank], rank) == num_workers:
        return copy.deepcopy(old[rank])  # nothing changes: the loader's own state
    readers = _readers(old)
    readers_now = max(num_workers, 1)

    def refuse(stage: str, why: str) -> ValueError:
        return ValueError(
            f"{_OWNER}: the loader states hold {len(readers)} readers, the new loader has "
            f"{world_size * readers_now}, and {stage} cannot be elastic "
            f"({why}); build each reader's pipeline as a ShardedIterator "
            "(e.g. functools.partial(ShardedIterator, shard_factory, num_shards)), or "
            "resume with the same numbers of ranks and workers"
        )

    def check_shards(num_shards: int) -> None:
        if world_size * readers_now > num_shards:
            raise ValueError(
                f"{_OWNER}: the new job would have {world_size * readers_now} readers "
                f"(world_size={world_size} x num_workers={num_workers}, at least 1 reader per "
                f"rank) for the {num_shards} shards that the states hold: a reader beyond the "
                "shards would read nothing (readers are numbered rank by rank, so the last "
                f"ranks would get no data); use at most {num_shards} readers in all (the number "
                "of shards is fixed for the whole training)"
            )

    pooling = Pooling(_OWNER, "reader", refuse, check_shards=check_shards)
    datasets = []
    for worker in range(readers_now):
        instance_rank, num_instances = reader_identity(rank, world_size, worker, readers_now)
        pipeline = redistributed_state(readers, instance_rank, num_instances, pooling)
        datasets.append(
            {
                "kind": KIND,
                "instance_rank": instance_rank,
                "num_instances": num_instances,
                "pipeline": pipeline,
            }
        )
    main, steps = _main_fields(old[rank % len(old)], rank % len(old))
    finished = all(state.get(_FINISHED) is True for state in old)
    return _loader_state(datasets, num_workers, main, steps, finished)


def _summary(value: object) -> str:
    if isinstance(value, list):
        return f"a list of {[type(item).__name__ for item in value]}"
    return type(value).__name__


def _workers_of(state: dict[str, Any], rank: int) -> int:
    """The number of workers of the loader that saved `state` (0: none)."""
    if _SNAPSHOT in state:
        snapshot = _part(state, _SNAPSHOT, dict, f"rank {rank}'s state")
        return len(_part(snapshot, _WORKERS, dict, f"rank {rank}'s {_SNAPSHOT}"))
    if _NUM_YIELDED in state:
        return 0
    raise ValueError(
        f"{_OWNER}: rank {rank}'s state is not a StatefulDataLoader state: it has neither "
        f"{_SNAPSHOT!r} (with workers) nor {_NUM_YIELDED!r} (without), but keys "
        f"{sorted(state)}"
    )


def _part(container: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = container.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(
            f"{_OWNER}: {where} needs {key!r} of type {kind.__name__}, got {_summary(value)}"
            if key in container
            else f"{_OWNER}: {where} lacks {key!r}"
        )
    return value


def _dataset_states(state: dict[str, Any], rank: int) -> list[tuple[str, Any]]:
    """``(where, dataset state)`` of each reader of one old rank's loader state."""
    where = f"rank {rank}'s state"
    if _workers_of(state, rank) == 0:
        return [(where, state.get("dataset_state"))]
    snapshot = state[_SNAPSHOT]
    since = _part(state, _SINCE, int, where)
    if since:
        raise ValueError(
            f"{_OWNER}: {where} was taken {since} steps after its last snapshot "
            "(StatefulDataLoader(snapshot_every_n_steps > 1)): its workers' positions are "
            "known only at snapshots; save loader states with snapshot_every_n_steps=1 (the "
            "default) to change the number of workers"
        )
    workers = snapshot[_WORKERS]
    keys = [f"worker_{index}" for index in range(len(workers))]
    if sorted(workers) != sorted(keys):
        raise ValueError(f"{_OWNER}: {where} has worker states {sorted(workers)}, not {keys}")
    return [
        (f"{where}, {key}", _part(workers, key, dict, where).get("dataset_state")) for key in keys
    ]


def _readers(old: list[dict[str, Any]]) -> list[State]:
    """The pipeline states of every old reader, in reader order."""
    by_reader: dict[int, State] = {}
    total = None
    for rank, state in enumerate(old):
        for where, dataset_state in _dataset_states(state, rank):
            try:
                reader = checked_state(dataset_state)
            except StateMismatchError as error:
                raise ValueError(f"{_OWNER}: {where}: 'dataset_state': {error}") from None
            identity = (reader["instance_rank"], reader["num_instances"])
            if total is None:
                total = identity[1]
            if identity[1] != total or identity[0] in by_reader or not 0 <= identity[0] < total:
                raise ValueError(
                    f"{_OWNER}: {where} is the state of reader {identity[0]} of {identity[1]}, "
                    f"which does not fit the readers before it ({sorted(by_reader)} of "
                    f"{total}): give the states of one checkpoint of every old rank, in rank "
                    "order"
                )
            by_reader[identity[0]] = reader["pipeline"]
    if total is None or len(by_reader) != total:
        raise ValueError(
            f"{_OWNER}: the states hold readers {sorted(by_reader)} of {total}: give the "
            "states of every old rank"
        )
    return [by_reader[index] for index in range(total)]


def _main_fields(state: dict[str, Any], rank: int) -> tuple[dict[str, Any], int]:
    """The main process's fields of one old state, and the steps it had taken."""
    where = f"rank {rank}'s state"
    if _SNAPSHOT in state:
        snapshot = state[_SNAPSHOT]
        main = _part(snapshot, _MAIN, dict, f"{where}'s {_SNAPSHOT}")
        steps = _part(snapshot, _STEP, int, f"{where}'s {_SNAPSHOT}")
    else:
        main, steps = state, _part(state, _NUM_YIELDED, int, where)
    missing = [key for key in _SAMPLER_KEYS if key not in main]
    if missing:
        raise ValueError(f"{_OWNER}: {where} lacks the main process's fields {missing}")
    fields = {key: main[key] for key in _SAMPLER_KEYS}
    fields[_BASE_SEED] = main.get(_BASE_SEED, 0)  # a loader without workers has none
    return fields, steps


def _loader_state(
    datasets: list[State], num_workers: int, main: dict[str, Any], steps: int, finished: bool
) -> dict[str, Any]:
    """A StatefulDataLoader state of `num_workers` workers with these readers' states."""

    def fetcher() -> dict[str, Any]:
        return {"dataset_iter_state": None, "fetcher_ended": False}

    base_seed = main.pop(_BASE_SEED)
    if num_workers == 0:
        return {
            **main,
            _NUM_YIELDED: steps,
            "fetcher_state": fetcher(),
            "dataset_state": datasets[0],
            _FINISHED: finished,
        }
    workers = {
        f"worker_{index}": {"worker_id": index, "fetcher_state": fetcher(), "dataset_state": state}
        for index, state in enumerate(datasets)
    }
    snapshot = {
        _STEP: steps,
        _LAST_WORKER: num_workers - 1,  # the next batch comes from worker 0
        _MAIN: {_NUM_WORKERS: num_workers, **main, _BASE_SEED: base_seed},
        _WORKERS: workers,
    }
    return {_SNAPSHOT: snapshot, _SINCE: 0, _FINISHED: finished}
