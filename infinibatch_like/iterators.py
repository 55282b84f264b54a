"""infinibatch-compatible face: every iterator under the names of ``infinibatch.iterators``.

``from infinibatch_like.iterators import *`` also provides the helper names that
infinibatch's star import leaks and that user code may rely on (``Random``, ``Iterator``,
``islice``, the typing names and the standard modules it imports).
"""

from __future__ import annotations

import collections.abc
import copy
import gzip
import logging
import math
import multiprocessing
import os
import queue
import threading
import time
from abc import abstractmethod
from itertools import cycle, islice
from random import Random
from typing import (  # noqa: UP035 - infinibatch's star import provides these names
    Any,
    Callable,
    Dict,
    Generator,
    Iterable,
    Iterator,
    List,
    Optional,
    Tuple,
    Union,
    cast,
)

from ._core.protocol import CheckpointableIterator, StateMismatchError
from .background.errors import WorkerError
from .stages.batching import BucketedReadaheadBatchIterator, FixedBatchIterator
from .stages.batchmap import BatchMapIterator
from .stages.flatten import SelectManyIterator
from .stages.mapping import MapIterator, SamplingRandomMapIterator
from .stages.multiplex import MultiplexIterator, MultiplexSourceExhaustedError, ZipIterator
from .stages.parallel_map import ParallelMapIterator
from .stages.permutation import PermutationSourceIterator
from .stages.prefetch import PrefetchIterator
from .stages.recurrent import RecurrentIterator
from .stages.shuffle import BlockwiseShuffleIterator, BufferedShuffleIterator
from .stages.sources import (
    ChunkedSourceIterator,
    InfinitePermutationSourceIterator,
    NativeCheckpointableIterator,
    RandomIterator,
    create_source_iterator,
)
from .stages.weighted import WeightedMultiplexIterator
from .stages.windowing import WindowedIterator

logger = logging.getLogger(__name__)


def _advance_iterator(iterator: Iterator[Any], n: int) -> int:
    """Advance `iterator` by `n` items and return `n`.

    Raises:
        RuntimeError: if the iterator ends before `n` items.
    """
    for index in range(n):
        try:
            next(iterator)
        except StopIteration:
            raise RuntimeError(
                f"_advance_iterator: the iterator ended after {index} of {n} items"
            ) from None
    return n


__all__ = [
    # the iterators
    "BatchMapIterator",
    "BlockwiseShuffleIterator",
    "BucketedReadaheadBatchIterator",
    "BufferedShuffleIterator",
    "CheckpointableIterator",
    "ChunkedSourceIterator",
    "FixedBatchIterator",
    "InfinitePermutationSourceIterator",
    "MapIterator",
    "MultiplexIterator",
    "NativeCheckpointableIterator",
    "ParallelMapIterator",
    "PermutationSourceIterator",
    "PrefetchIterator",
    "RandomIterator",
    "RecurrentIterator",
    "SamplingRandomMapIterator",
    "SelectManyIterator",
    "WeightedMultiplexIterator",
    "WindowedIterator",
    "ZipIterator",
    "create_source_iterator",
    # this library's errors
    "MultiplexSourceExhaustedError",
    "StateMismatchError",
    "WorkerError",
    # names that infinibatch's star import leaks and user code relies on
    "Any",
    "Callable",
    "Dict",
    "Generator",
    "Iterable",
    "Iterator",
    "List",
    "Optional",
    "Random",
    "Tuple",
    "Union",
    "abstractmethod",
    "cast",
    "collections",
    "copy",
    "cycle",
    "islice",
    "gzip",
    "logger",
    "logging",
    "math",
    "multiprocessing",
    "os",
    "queue",
    "threading",
    "time",
]
