"""Many ranks: rank discovery, one checkpoint for all ranks, equal-length passes, virtual
shards and elastic resume on another number of ranks.

- `ranks`: where this process stands in a `torch.distributed` job; `gather_state`; the
  collective the equal-length passes agree through.
- `equal_length`: `EqualLengthIterator`, finite passes that end on the same step everywhere.
- `arrivals`: which rank came last to a collective (for statistics).
- `sharded`: `ShardedIterator`, a fixed number of virtual shards spread over the ranks.
- `elastic`: `restore_state`, this rank's part of a gathered checkpoint, on the same or a
  new number of ranks.

torch is optional: it is imported only while a process group is initialized.
"""

from .elastic import elastic_state, redistributed_state, restore_state, why_not_elastic
from .equal_length import EqualLengthIterator
from .ranks import gather_state, rank_and_world_size
from .sharded import ShardedIterator, owned_shards

__all__ = [
    "EqualLengthIterator",
    "ShardedIterator",
    "elastic_state",
    "gather_state",
    "owned_shards",
    "rank_and_world_size",
    "redistributed_state",
    "restore_state",
    "why_not_elastic",
]
