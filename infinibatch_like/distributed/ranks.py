"""Many ranks: where this process stands in a `torch.distributed` job, one checkpoint
for all ranks, and the collective the equal-length passes agree through.

torch is an optional dependency: this module imports it only while a process group is
initialized, which means the caller has imported it already. Without a process group, in
a single process, everything here works without torch.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from .._core.protocol import GATHERED_FORMAT, CheckpointableIterator

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


def group_rank_and_size(owner: str, group: ProcessGroup | None) -> tuple[int, int]:
    """This rank and the number of ranks in `group` (None: the whole job); `owner` names
    the caller in errors."""
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
    `infinibatch_like.distributed.elastic.restore_state` gives each rank its own part
    back. The states travel through ``torch.distributed.all_gather_object`` (with the
    NCCL backend, call ``torch.cuda.set_device`` first, as that function requires).
    Without a process group and with a world size of 1 it needs no torch at all.

    Returns:
        ``{"format": GATHERED_FORMAT, "world_size": W, "ranks": [state_0, ..., state_W-1]}``
        (plain data: ``torch.load(..., weights_only=True)`` and JSON can hold it).

    Raises:
        RuntimeError: if ``$WORLD_SIZE`` says there are several ranks but no process group
            is initialized.
    """
    _, world_size = group_rank_and_size("gather_state", group)
    state = iterator.getstate()
    dist = _process_group_module()
    states: list[Any] = [state]
    if dist is not None:
        states = [None] * world_size
        dist.all_gather_object(states, state, group=group)
    return {"format": GATHERED_FORMAT, "world_size": world_size, "ranks": states}


def rank_in(group: ProcessGroup | None) -> int:
    return group_rank_and_size("EqualLengthIterator", group)[0]


def all_reduce_max(flags: list[int], group: ProcessGroup | None) -> list[int]:
    """The element-wise maximum of `flags` over the ranks of `group` (a collective call)."""
    dist = _process_group_module()
    if dist is None:
        group_rank_and_size("EqualLengthIterator", group)
        return flags
    import torch

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor(flags, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(value) for value in tensor.tolist()]
