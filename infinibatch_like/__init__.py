"""infinibatch_like: checkpointable, composable iterators for randomized data loading.

A drop-in replacement for infinibatch 0.1.1: ``import infinibatch_like`` provides every
iterator of `infinibatch_like.iterators`, and every other public name of the library.

The package, by concern:

- `iterators`, `datasets`: the faces compatible with infinibatch 0.1.1.
- `stages`: every public stage, one family per module.
- `background`: the worker threads and processes background stages share; the watchdog.
- `distributed`: ranks, equal-length passes, virtual shards, elastic resume.
- `checkpoint`: checkpoint files and their inspection.
- `testing`: the public conformance checker of the checkpoint contract.
- `io`: chunk formats and storage (local, object stores), retries and caches.
- `prepare`: the chunk tool (a corpus into chunks and an index) and progress bars.
- `stats`: per-stage statistics, the limiting stage, per-sample lineage.
- `torch`: PyTorch datasets, collation, DataLoader states (needs torch).
- `_core`: the protocol and `Stage`, the base every stage builds on.
"""

from . import stats
from ._core.protocol import CheckpointableIterator, SkippableIterator, StateMismatchError
from .background import (
    StallError,
    Watchdog,
    WorkerError,
    empty_shared_pool,
    set_worker_gc,
    shared_empty,
    shared_zeros,
    start_background,
)
from .checkpoint import (
    CheckpointFileError,
    CheckpointNotFoundError,
    DamagedCheckpointWarning,
    LoadedCheckpoint,
    describe_state,
    inspect_lines,
    load_checkpoint,
    load_checkpoint_info,
    save_checkpoint,
)
from .datasets import bump_seed, chunked_dataset_iterator
from .distributed import (
    EqualLengthIterator,
    ShardedIterator,
    elastic_state,
    gather_state,
    owned_shards,
    rank_and_world_size,
    redistributed_state,
    restore_state,
    why_not_elastic,
)
from .stages import (
    BatchMapIterator,
    BlockwiseShuffleIterator,
    BucketedReadaheadBatchIterator,
    BufferedShuffleIterator,
    ChunkedSourceIterator,
    FanOut,
    FanOutConsumer,
    FilterIterator,
    FixedBatchIterator,
    InfinitePermutationSourceIterator,
    MapIterator,
    MultiplexIterator,
    MultiplexSourceExhaustedError,
    NativeCheckpointableIterator,
    PackedSequence,
    PackingIterator,
    ParallelMapIterator,
    PermutationSourceIterator,
    PrefetchIterator,
    RandomIterator,
    RecurrentIterator,
    RemoteConsumer,
    SamplingRandomMapIterator,
    SelectManyIterator,
    SkipBudgetExceeded,
    SkipIterator,
    SkipLedger,
    SkipPolicy,
    TokenBudgetMultiplexIterator,
    WeightedMultiplexIterator,
    WindowedIterator,
    ZipIterator,
    attach,
    create_source_iterator,
)
from .testing import ContractViolation, ResumeMismatch, assert_checkpointable, check_resume

__version__ = "0.1.0"
__all__ = [
    "BatchMapIterator",
    "BlockwiseShuffleIterator",
    "BucketedReadaheadBatchIterator",
    "BufferedShuffleIterator",
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "CheckpointableIterator",
    "ChunkedSourceIterator",
    "ContractViolation",
    "DamagedCheckpointWarning",
    "EqualLengthIterator",
    "FanOut",
    "FanOutConsumer",
    "FilterIterator",
    "FixedBatchIterator",
    "InfinitePermutationSourceIterator",
    "LoadedCheckpoint",
    "MapIterator",
    "MultiplexIterator",
    "MultiplexSourceExhaustedError",
    "NativeCheckpointableIterator",
    "PackedSequence",
    "PackingIterator",
    "ParallelMapIterator",
    "PermutationSourceIterator",
    "PrefetchIterator",
    "RandomIterator",
    "RecurrentIterator",
    "RemoteConsumer",
    "ResumeMismatch",
    "SamplingRandomMapIterator",
    "SelectManyIterator",
    "ShardedIterator",
    "SkipBudgetExceeded",
    "SkipIterator",
    "SkipLedger",
    "SkipPolicy",
    "SkippableIterator",
    "StallError",
    "StateMismatchError",
    "TokenBudgetMultiplexIterator",
    "Watchdog",
    "WeightedMultiplexIterator",
    "WindowedIterator",
    "WorkerError",
    "ZipIterator",
    "__version__",
    "assert_checkpointable",
    "attach",
    "bump_seed",
    "check_resume",
    "chunked_dataset_iterator",
    "create_source_iterator",
    "describe_state",
    "elastic_state",
    "empty_shared_pool",
    "gather_state",
    "inspect_lines",
    "load_checkpoint",
    "load_checkpoint_info",
    "owned_shards",
    "rank_and_world_size",
    "redistributed_state",
    "restore_state",
    "save_checkpoint",
    "set_worker_gc",
    "shared_empty",
    "shared_zeros",
    "start_background",
    "stats",
    "why_not_elastic",
]
