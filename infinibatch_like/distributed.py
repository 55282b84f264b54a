"""Many ranks: where this process stands in a `torch.distributed` job, one checkpoint
for all ranks, and finite passes that end on the same step everywhere.

torch is an optional dependency: this module imports it only while a process group is
initialized, which means the caller has imported it already. Without a process group, in
a single process, everything here works without torch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from ._arrivals import Arrivals
from ._base import (
    GATHERED_FORMAT,
    CheckpointableIterator,
    Stage,
    State,
    fast_iterator,
    require_callable,
    require_checkpointable,
    source_state,
)
from ._fingerprint import described

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"rank_and_world_size: ${name} must be an integer, got {value!r}"
        ) from None


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the number of ranks.

    From the initialized default `torch.distributed` process group if there is one, else from
    the ``RANK`` and ``WORLD_SIZE`` environment variables (set by ``torchrun``), else
    ``(0, 1)``. torch is not imported by this function: a process group exists only if the
    caller imported torch already.

    Raises:
        ValueError: if the environment variables are not integers, only one of them is set,
            or they do not satisfy ``0 <= RANK < WORLD_SIZE``.
    """
    dist = _process_group_module()
    if dist is not None:
        return int(dist.get_rank()), int(dist.get_world_size())
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None and world_size is None:
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(
            "rank_and_world_size: $RANK and $WORLD_SIZE must be set together, got "
            f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank_and_world_size: need 0 <= $RANK < $WORLD_SIZE, got RANK={rank}, "
            f"WORLD_SIZE={world_size}"
        )
    return rank, world_size


def _process_group_module() -> ModuleType | None:
    """``torch.distributed`` if the caller imported it and initialized a process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _group_rank_and_size(owner: str, group: ProcessGroup | None) -> tuple[int, int]:
    dist = _process_group_module()
    if dist is not None:
        return int(dist.get_rank(group)), int(dist.get_world_size(group))
    rank, world_size = rank_and_world_size()
    if world_size != 1:
        raise RuntimeError(
            f"{owner}: $WORLD_SIZE is {world_size} but no torch.distributed process group is "
            "initialized; call torch.distributed.init_process_group() first"
        )
    return rank, world_size


def gather_state(
    iterator: CheckpointableIterator[Any], group: ProcessGroup | None = None
) -> dict[str, Any]:
    """Every rank's `iterator` state in one plain-data dict, identical on all ranks.

    A collective call: every rank of `group` (default: the whole job) must call it at the
    same point (typically where the model is checkpointed). Rank 0 alone can then save the
    result next to the model, e.g. ``torch.save({"model": ..., "data": gathered}, path)``;
    `restore_state` gives each rank its own part back. The states travel through
    ``torch.distributed.all_gather_object`` (with the NCCL backend, call
    ``torch.cuda.set_device`` first, as that function requires). Without a process group
    and with a world size of 1 it needs no torch at all.

    Returns:
        ``{"format": GATHERED_FORMAT, "world_size": W, "ranks": [state_0, ..., state_W-1]}``
        (plain data: ``torch.load(..., weights_only=True)`` and JSON can hold it).

    Raises:
        RuntimeError: if ``$WORLD_SIZE`` says there are several ranks but no process group
            is initialized.
    """
    _, world_size = _group_rank_and_size("gather_state", group)
    state = iterator.getstate()
    dist = _process_group_module()
    states: list[Any] = [state]
    if dist is not None:
        states = [None] * world_size
        dist.all_gather_object(states, state, group=group)
    return {"format": GATHERED_FORMAT, "world_size": world_size, "ranks": states}


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
    (`infinibatch_like.elastic`): every shard continues exactly where it stopped, on
    exactly one rank.

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
    rank, world_size = _group_rank_and_size("restore_state", group)
    if world_size != saved_size:
        from .elastic import elastic_state

        iterator.setstate(elastic_state(iterator, states, rank, world_size))
        return
    iterator.setstate(states[rank])


def _rank_in(group: ProcessGroup | None) -> int:
    return _group_rank_and_size("EqualLengthIterator", group)[0]


def _all_reduce_max(flags: list[int], group: ProcessGroup | None) -> list[int]:
    """The element-wise maximum of `flags` over the ranks of `group` (a collective call)."""
    dist = _process_group_module()
    if dist is None:
        _group_rank_and_size("EqualLengthIterator", group)
        return flags
    import torch

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(value) for value in tensor.tolist()]


_POLICIES = ("pad", "drop")
_NOTHING: Any = object()
_PHASES = ("running", "padding", "ended")


class EqualLengthIterator(Stage[T]):
    """Makes every rank yield the same number of items in a finite pass (for DDP).

    In a distributed evaluation, ranks whose shares differ in length would run different
    numbers of steps, and the collectives inside DistributedDataParallel would hang. Before
    each item the ranks agree (one ``all_reduce`` of four integers over `group`: three
    flags, and the rank's arrival, from which statistics tell the rank the others
    wait for) on whether to go on:

    - ``policy="pad"`` (default): the pass lasts as long as the longest rank's share. A
      rank whose share has ended yields padding: its share again from the start (cycling,
      like ``DistributedSampler``) or, with `fill`, ``fill()``. `last_is_padding` tells
      whether the item just yielded is padding, so that metrics can skip it. If a rank
      has nothing to repeat (an empty share and no `fill`), every rank raises the same
      RuntimeError at the same step.
    - ``policy="drop"``: the pass ends on every rank when the shortest share ends. The
      other ranks count the rest of their share (reading it) as dropped: the dropped items
      are the last ``counts["dropped"]`` items of that rank's share.

    Each rank keeps ``counts``: ``{"real", "padded", "dropped"}``. The wrapper is for
    finite passes (``train=False``, or training with ``epochs=``); on an endless stream it
    only adds a collective per item. In a training epoch under DDP a padding step must
    still run forward and backward: give a `fill` that makes a batch of the real batches'
    structure (e.g. one item of one pad token, ``fill=lambda: [[PAD]]``, before
    collation) or repeat the share, and weight the loss of a padding step by 0. Without a
    process group (a single process) it needs no torch.

    Args:
        source_iterator: this rank's finite pass (e.g. batches); reset after it ends when
            it pads by repeating.
        policy: ``"pad"`` or ``"drop"``.
        fill: with ``"pad"``, makes a padding item instead of repeating the share: an
            empty batch (``list``) for metrics, a batch the model accepts in training.
        group: the process group of the ranks that must agree (default: the whole job).

    Raises:
        ValueError: for a bad `policy` or a source that is not checkpointable.
        TypeError: for a `fill` that is not callable.

    Checkpoint:
        ``{"source", "phase", "real", "padded", "dropped"}``: the source's state (when
        padding by repeating, its position in the repeated share), the phase
        (``"running"``, ``"padding"`` or ``"ended"``) and the counts. Constant size; a
        restore re-reads nothing. All ranks must restore states taken at the same step
        (e.g. from one `gather_state`). Over a `ShardedIterator` (under `MapIterator`
        stages), `restore_state` resumes it on another number of ranks: the real items
        left move with their shards, and the new ranks start with phase ``"running"``
        and zero counts (see `infinibatch_like.elastic`). A rank with no real item yet
        that must pad restarts its share to learn whether there is anything to repeat.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "source": dict,
        "phase": str,
        "real": int,
        "padded": int,
        "dropped": int,
    }
    _user_callables = ("fill",)

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        policy: str = "pad",
        fill: Callable[[], T] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        require_checkpointable("EqualLengthIterator", "source_iterator", source_iterator)
        if policy not in _POLICIES:
            raise ValueError(
                f"EqualLengthIterator: policy must be one of {_POLICIES}, got {policy!r}"
            )
        if fill is not None:
            require_callable("EqualLengthIterator", "fill", fill)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._drop = policy == "drop"
        self._fill = fill
        self._group = group
        self._restore(None)

    def _arguments(self) -> State:
        return {"policy": "drop" if self._drop else "pad", "fill": described(self._fill)}

    @property
    def last_is_padding(self) -> bool:
        """Whether the item yielded last is padding (the share had ended)."""
        return self._phase == "padding"

    @property
    def counts(self) -> dict[str, int]:
        """This rank's items so far: ``{"real", "padded", "dropped"}``."""
        return {"real": self._real, "padded": self._padded, "dropped": self._dropped}

    def _state(self) -> State:
        return {"source": source_state(self._source), "phase": self._phase, **self.counts}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"], "source")
        if state is None:
            self._phase, self._real, self._padded, self._dropped = "running", 0, 0, 0
        else:
            counts = [state["real"], state["padded"], state["dropped"]]
            if state["phase"] not in _PHASES or min(counts) < 0:
                raise self.mismatch(
                    f"expected a phase in {_PHASES} and counts >= 0, got {state['phase']!r} "
                    f"and {counts}"
                )
            self._phase = state["phase"]
            self._real, self._padded, self._dropped = counts
        self._iterator = self._generate()

    def _restarted(self) -> Iterator[T]:
        """The source, restarted from the start of the share (to repeat it as padding)."""
        self.restore_source(self._source, None, "source")
        return fast_iterator(self._source)

    def _generate(self) -> Iterator[T]:
        pull = fast_iterator(self._source)
        first: Any = _NOTHING  # the share's first item, read to learn if there is one
        arrivals = Arrivals(_rank_in(self._group))  # which rank the others wait for
        while self._phase != "ended":
            running = self._phase == "running"
            item = next(pull, _NOTHING) if running else _NOTHING
            has_item = item is not _NOTHING
            stuck = False
            repeats = not has_item and not self._drop and self._fill is None
            if running and repeats and self._real == 0:
                # Nothing real yet: the share is empty, or this rank took other ranks'
                # shards in an elastic restore; restart the share to see if it has items.
                pull = self._restarted()
                first = next(pull, _NOTHING)
                stuck = first is _NOTHING
            flags = [int(not has_item), int(has_item), int(stuck), arrivals.code()]
            entered = time.perf_counter()
            someone_lacks, someone_has, someone_stuck, last = _all_reduce_max(flags, self._group)
            arrivals.left_collective(entered, last, self._probe)
            if someone_lacks if self._drop else not someone_has:
                self._phase = "ended"
                if has_item:
                    self._dropped += 1 + sum(1 for _ in pull)
                return
            if someone_stuck:
                raise RuntimeError(
                    "EqualLengthIterator: a rank's share is empty, so it has nothing to repeat "
                    "as padding; pass fill= (e.g. fill=list for empty batches) or use "
                    'policy="drop"'
                )
            if has_item:
                self._real += 1
            else:
                if self._fill is not None:
                    item = self._fill()
                else:
                    item, first = first, _NOTHING
                    if item is _NOTHING:
                        item = next(pull, _NOTHING)
                    if item is _NOTHING:  # repeat the share from its start
                        pull = self._restarted()
                        item = next(pull)
                self._phase = "padding"
                self._padded += 1
            yield cast(T, item)
