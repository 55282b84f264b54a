"""`CheckpointableDataset`: a pipeline per DataLoader reader, with resumable state dicts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from .._core.checks import require_callable, require_int
from .._core.extras import missing_extra
from .._core.protocol import CheckpointableIterator, State, StateMismatchError
from .._core.schema import FieldSpec, Int, SchemaError, check_fields

try:
    import torch.utils.data
except ModuleNotFoundError as error:  # pragma: no cover - exercised in a subprocess test
    raise missing_extra("torch", "torch", "infinibatch_like.torch.CheckpointableDataset") from error
from ..distributed.ranks import rank_and_world_size

T_co = TypeVar("T_co", covariant=True)

PipelineFactory = Callable[[int, int], CheckpointableIterator[T_co]]
"""Builds the pipeline of one reader: ``factory(instance_rank, num_instances)``."""

KIND = "CheckpointableDataset"
"""The ``"kind"`` of `CheckpointableDataset` states."""
_FIELDS: dict[str, FieldSpec] = {"instance_rank": Int(0), "num_instances": Int(1), "pipeline": dict}
"""The fields of a `CheckpointableDataset` state besides its ``"kind"``."""

_NO_PIPELINE_HERE = (
    "CheckpointableDataset.state_dict: no pipeline has been built in this process yet, so "
    "there is no position to save. If a torch.utils.data.DataLoader with num_workers > 0 "
    "reads this dataset, its readers live in the worker processes and their states cannot "
    "be reached from the main process: use torchdata's StatefulDataLoader (which collects "
    "them), or num_workers=0. A run that has not started needs no data state."
)


def reader_identity(
    rank: int, world_size: int, worker_id: int, num_workers: int
) -> tuple[int, int]:
    """The ``(instance_rank, num_instances)`` of DataLoader worker `worker_id` on `rank`.

    Readers are numbered rank by rank: ``rank * num_workers + worker_id`` out of
    ``world_size * num_workers``, so no two workers of any rank share an instance.
    """
    return rank * num_workers + worker_id, world_size * num_workers


class CheckpointableDataset(torch.utils.data.IterableDataset[T_co]):
    """A `torch.utils.data.IterableDataset` over one pipeline per reader, resumable exactly.

    Each reader (the main process with ``num_workers=0``, else each DataLoader worker of
    each rank) calls ``factory(instance_rank, num_instances)`` to build its own pipeline,
    where ``instance_rank = rank * num_workers + worker_id`` and
    ``num_instances = world_size * num_workers``. Pass both to the sharding arguments of
    your pipeline (``chunked_dataset_iterator(..., num_instances=..., instance_rank=...)``)
    so that no two readers read the same data. The pipeline is built lazily, by
    ``iter(dataset)`` in the process that reads it, and every ``iter`` builds a fresh
    pipeline (an epoch of a finite pipeline starts over), closing the previous one.

    ``state_dict()`` and ``load_state_dict()`` follow the protocol of torchdata's
    ``StatefulDataLoader``, which calls them inside each worker and stores one state per
    worker, so ``StatefulDataLoader(dataset, num_workers=k)`` resumes exactly. With the
    plain ``torch.utils.data.DataLoader`` and ``num_workers=0`` call them on the dataset
    yourself. The plain DataLoader with workers cannot be checkpointed: the workers'
    pipelines are out of reach, and ``state_dict()`` in the main process raises.

    Another number of workers (or of ranks) on resume: torchdata's loader refuses a state
    of another ``num_workers`` itself, and each reader's state here belongs to one reader.
    Build the factory as ``functools.partial(ShardedIterator, shard_factory, num_shards)``
    (each reader then runs the shards it owns among the readers; give each shard its
    chunks from ``ChunkIndex.shards`` or `infinibatch_like.prepare.balancing.balanced_shards`,
    which split them by item count) and convert the loader states of every old rank with
    `infinibatch_like.torch.resize_loader_state`: every shard continues where it stopped,
    on exactly one new reader.

    Args:
        factory: ``factory(instance_rank, num_instances)`` returns a new
            `CheckpointableIterator`; with DataLoader workers under the ``spawn`` or
            ``forkserver`` start method it must pickle (a module-level function or a
            ``functools.partial`` of one).
        rank: this process's rank; with `world_size`, overrides
            `infinibatch_like.distributed.ranks.rank_and_world_size`, which is otherwise asked
            once, here, in the constructor (construct the dataset after
            ``torch.distributed.init_process_group``, or under ``torchrun``).
        world_size: the number of ranks; give it together with `rank`.

    Raises:
        TypeError: if `factory` is not callable, or `rank`/`world_size` are not ints.
        ValueError: if only one of `rank` and `world_size` is given, or
            ``0 <= rank < world_size`` does not hold.

    Checkpoint:
        ``{"kind": "CheckpointableDataset", "instance_rank": int, "num_instances": int,
        "pipeline": <the pipeline's getstate()>}``: plain data of the pipeline's (constant)
        size plus three fields; ``load_state_dict`` refuses the state of another reader or
        another number of readers (`resize_loader_state` converts the states of
        `ShardedIterator` readers). A restore costs what the pipeline's ``setstate`` costs.
    """

    def __init__(
        self,
        factory: PipelineFactory[T_co],
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        require_callable("CheckpointableDataset", "factory", factory)
        self._factory = factory
        self._rank, self._world_size = _rank_and_world_size(rank, world_size)
        self._pipeline: CheckpointableIterator[T_co] | None = None
        self._identity: tuple[int, int] | None = None
        self._built_in: int | None = None  # the process id that built the pipeline
        self._pending: State | None = None

    @property
    def rank(self) -> int:
        """This process's rank, as resolved by the constructor."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks, as resolved by the constructor."""
        return self._world_size

    def current_reader(self) -> tuple[int, int]:
        """``(instance_rank, num_instances)`` of the calling process: main process or worker."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return reader_identity(self._rank, self._world_size, 0, 1)
        return reader_identity(self._rank, self._world_size, info.id, info.num_workers)

    def __iter__(self) -> CheckpointableIterator[T_co]:
        """Build this reader's pipeline, continuing from a loaded state if there is one."""
        identity = self.current_reader()
        pipeline = self._factory(*identity)
        if not isinstance(pipeline, CheckpointableIterator):
            raise TypeError(
                f"CheckpointableDataset: factory{identity} must return a "
                f"CheckpointableIterator, got {type(pipeline).__name__}"
            )
        pending, self._pending = self._pending, None
        if pending is not None:
            self._restore(pipeline, identity, pending)
        self.close()
        self._pipeline, self._identity, self._built_in = pipeline, identity, os.getpid()
        return pipeline

    def state_dict(self) -> State:
        """This reader's position: plain data, safe for ``torch.load(weights_only=True)``.

        Returns the state loaded by `load_state_dict` if no pipeline was built since.

        Raises:
            RuntimeError: if no pipeline was built in this process and none was loaded, as
                in the main process of a plain DataLoader with ``num_workers > 0``.
        """
        if self._pending is not None:
            return self._pending
        if self._pipeline is None or self._identity is None or self._built_in != os.getpid():
            raise RuntimeError(_NO_PIPELINE_HERE)
        instance_rank, num_instances = self._identity
        return {
            "kind": KIND,
            "instance_rank": instance_rank,
            "num_instances": num_instances,
            "pipeline": self._pipeline.getstate(),
        }

    def load_state_dict(self, state: State) -> None:
        """Continue from `state` (a `state_dict` result) when the pipeline is next built.

        The state is checked for form here; that it belongs to the reader that builds the
        pipeline, and fits the pipeline, is checked by the next ``iter(dataset)``.

        Raises:
            StateMismatchError: (a ValueError) if `state` is not a state of this class.
        """
        self._pending = checked_state(state)

    def close(self) -> None:
        """Close the current pipeline, if any (a later ``iter`` builds a new one).

        A pipeline inherited from a parent process (a forked DataLoader worker) is only
        forgotten, never closed: its background resources belong to the parent.
        """
        if self._pipeline is not None and self._built_in == os.getpid():
            self._pipeline.close()
        self._pipeline, self._identity, self._built_in = None, None, None

    def _restore(
        self, pipeline: CheckpointableIterator[Any], identity: tuple[int, int], state: State
    ) -> None:
        saved = (state["instance_rank"], state["num_instances"])
        if saved != identity:
            pipeline.close()
            raise _mismatch(
                f"the state belongs to reader {saved[0]} of {saved[1]}, this is reader "
                f"{identity[0]} of {identity[1]} (rank {self._rank} of {self._world_size}); "
                "resume with the same world size and number of DataLoader workers, or convert "
                "the loader's state with infinibatch_like.torch.resize_loader_state"
            )
        try:
            pipeline.setstate(state["pipeline"])
        except StateMismatchError as error:
            pipeline.close()
            raise error.within(f"{KIND}.pipeline") from None

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers: the factory and the pending state, never a pipeline.
        return {**self.__dict__, "_pipeline": None, "_identity": None, "_built_in": None}


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None:
        return rank_and_world_size()
    if rank is None or world_size is None:
        raise ValueError(
            "CheckpointableDataset: give rank and world_size together, got "
            f"rank={rank!r}, world_size={world_size!r}"
        )
    require_int("CheckpointableDataset", "rank", rank, 0)
    require_int("CheckpointableDataset", "world_size", world_size, 1)
    if rank >= world_size:
        raise ValueError(
            f"CheckpointableDataset: need 0 <= rank < world_size, got rank={rank}, "
            f"world_size={world_size}"
        )
    return rank, world_size


def _mismatch(reason: str) -> StateMismatchError:
    return StateMismatchError(reason, (KIND,))


def checked_state(state: object) -> State:
    """`state`'s fields if it is a well-formed `CheckpointableDataset` state (keys that the
    caller added dropped), else a StateMismatchError naming what is wrong."""
    if not isinstance(state, dict):
        raise _mismatch(f"expected a dict, got {type(state).__name__}")
    if state.get("kind") != KIND:
        raise _mismatch(f"expected a state of {KIND}, got one of kind {state.get('kind')!r}")
    try:
        check_fields(_FIELDS, state, None)
    except SchemaError as error:
        raise _mismatch(str(error)) from None
    return {"kind": KIND, **{key: state[key] for key in _FIELDS}}  # keys added are ignored
