"""Every public stage, one family per module.

- `sources`: where items come from (a list, chunks, an endless permutation, random floats).
- `permutation`: shuffled indices for map-style data, one permutation per epoch.
- `flatten`: one item becomes many (`SelectManyIterator`: chunks into records, read ahead).
- `mapping`: one-to-one transforms (`MapIterator`, `SamplingRandomMapIterator`).
- `filter`: the items for which a predicate holds (`FilterIterator`).
- `batchmap`: transforms applied to lists of items at once (`BatchMapIterator`).
- `parallel_map`: a transform applied by worker processes or threads (`ParallelMapIterator`).
- `prefetch`: items produced ahead in a thread or a process (`PrefetchIterator`).
- `recurrent`: stateful transforms (`RecurrentIterator`).
- `windowing`: sliding windows (`WindowedIterator`).
- `shuffle`: block-wise and buffered shuffles.
- `batching`: fixed and bucketed, dynamically sized batches.
- `multiplex`: zipping and index-controlled interleaving.
- `weighted`: mixing sources by weight (`WeightedMultiplexIterator`).
- `budget`: mixing sources by tokens or any per-item cost (`TokenBudgetMultiplexIterator`).
- `packing`: documents of tokens packed into fixed-length sequences (`PackingIterator`).
- `skipping`: ranges of a stream left out on purpose (`SkipIterator`).
- `bad_records`: skipping items whose reading or transform raises (`SkipPolicy`, ledgers).
- `fanout`, `fanout_remote`: one pipeline read by several consumers (threads, processes).
- `_readahead`, `_packer`: shared parts of the read-ahead stages and of packing.
"""

from .bad_records import SkipBudgetExceeded, SkipLedger, SkipPolicy
from .batching import BucketedReadaheadBatchIterator, FixedBatchIterator
from .batchmap import BatchMapIterator
from .budget import TokenBudgetMultiplexIterator
from .fanout import FanOut, FanOutConsumer
from .fanout_remote import RemoteConsumer, attach
from .filter import FilterIterator
from .flatten import SelectManyIterator
from .mapping import MapIterator, SamplingRandomMapIterator
from .multiplex import MultiplexIterator, MultiplexSourceExhaustedError, ZipIterator
from .packing import PackedSequence, PackingIterator
from .parallel_map import ParallelMapIterator
from .permutation import PermutationSourceIterator
from .prefetch import PrefetchIterator
from .recurrent import RecurrentIterator
from .shuffle import BlockwiseShuffleIterator, BufferedShuffleIterator
from .skipping import SkipIterator
from .sources import (
    ChunkedSourceIterator,
    InfinitePermutationSourceIterator,
    NativeCheckpointableIterator,
    RandomIterator,
    create_source_iterator,
)
from .weighted import WeightedMultiplexIterator
from .windowing import WindowedIterator

__all__ = [
    "BatchMapIterator",
    "BlockwiseShuffleIterator",
    "BucketedReadaheadBatchIterator",
    "BufferedShuffleIterator",
    "ChunkedSourceIterator",
    "FanOut",
    "FanOutConsumer",
    "FilterIterator",
    "FixedBatchIterator",
    "InfinitePermutationSourceIterator",
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
    "SamplingRandomMapIterator",
    "SelectManyIterator",
    "SkipBudgetExceeded",
    "SkipIterator",
    "SkipLedger",
    "SkipPolicy",
    "TokenBudgetMultiplexIterator",
    "WeightedMultiplexIterator",
    "WindowedIterator",
    "ZipIterator",
    "attach",
    "create_source_iterator",
]
