"""Checkpoint files and their inspection.

- `files`: `save_checkpoint` (atomic, checksummed, with retention) and `load_checkpoint` /
  `load_checkpoint_info` (the newest intact file, refusing damaged ones).
- `format`: the layout of a checkpoint file: encoding, decoding and verifying it.
- `inspect`: a readable description of a saved state (``python -m infinibatch_like inspect``).
"""

from .files import (
    CheckpointFileError,
    CheckpointNotFoundError,
    DamagedCheckpointWarning,
    LoadedCheckpoint,
    load_checkpoint,
    load_checkpoint_info,
    save_checkpoint,
)
from .inspect import describe_state, inspect_lines

__all__ = [
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "DamagedCheckpointWarning",
    "LoadedCheckpoint",
    "describe_state",
    "inspect_lines",
    "load_checkpoint",
    "load_checkpoint_info",
    "save_checkpoint",
]
