"""PyTorch adapters: `CheckpointableDataset` for DataLoaders, `pad_batch` for collation.

``import infinibatch_like`` never imports torch. This subpackage imports it when
`CheckpointableDataset` is first used; `pad_batch` with ``to="numpy"`` works without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .collate import PaddedArrays, PaddedTensors, PadValue, pad_batch

if TYPE_CHECKING:
    from .dataset import CheckpointableDataset, PipelineFactory, reader_identity

__all__ = [
    "CheckpointableDataset",
    "PadValue",
    "PaddedArrays",
    "PaddedTensors",
    "PipelineFactory",
    "pad_batch",
    "reader_identity",
]

_NEEDS_TORCH = {"CheckpointableDataset", "PipelineFactory", "reader_identity"}


def __getattr__(name: str) -> Any:
    # Imports torch on first use of a name that needs it (PEP 562).
    if name in _NEEDS_TORCH:
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
