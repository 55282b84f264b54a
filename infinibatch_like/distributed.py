"""Many ranks: where this process stands in a `torch.distributed` job."""

from __future__ import annotations

import os
import sys


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
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
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
