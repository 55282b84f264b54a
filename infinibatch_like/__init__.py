"""infinibatch_like: checkpointable, composable iterators for randomized data loading.

A drop-in replacement for infinibatch 0.1.1: ``import infinibatch_like`` provides every
iterator of `infinibatch_like.iterators`.
"""

from ._background.stage import start_background
from ._background.worker_gc import set_worker_gc
from .budget import TokenBudgetMultiplexIterator
from .checkpoint_files import (
    CheckpointFileError,
    CheckpointNotFoundError,
    DamagedCheckpointWarning,
    LoadedCheckpoint,
    load_checkpoint,
    load_checkpoint_info,
    save_checkpoint,
)
from .fanout import FanOut, FanOutConsumer
from .fanout_remote import RemoteConsumer, attach
from .iterators import *  # noqa: F403
from .iterators import __all__ as _iterator_names
from .packing import PackedSequence, PackingIterator

__version__ = "0.1.0"
__all__ = [
    *_iterator_names,
    "start_background",
    "FanOut",
    "FanOutConsumer",
    "RemoteConsumer",
    "attach",
    "set_worker_gc",
    "save_checkpoint",
    "load_checkpoint",
    "load_checkpoint_info",
    "LoadedCheckpoint",
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "DamagedCheckpointWarning",
    "PackedSequence",
    "PackingIterator",
    "TokenBudgetMultiplexIterator",
    "__version__",
]
