"""PyTorch adapters: `CheckpointableDataset` for DataLoaders, `pad_batch` (and its typed
partial, `padder`) and `collate_packed` for collation.

``import infinibatch_like`` never imports torch, and importing this subpackage imports
neither torch nor numpy: torch is imported when `CheckpointableDataset` is first used,
numpy when `pad_batch` is (``to="numpy"`` works without torch), both when `collate_packed`
is. Both come with the ``torch`` extra (``pip install 'infinibatch_like[torch]'``).

Modules: `dataset` (`CheckpointableDataset`), `loader_state` (`resize_loader_state`),
`collate` (`pad_batch`, `padder`), `packed` (`collate_packed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .collate import (
        PaddedArrays,
        PaddedArraysNoMask,
        PaddedTensors,
        PaddedTensorsNoMask,
        PadOptions,
        PadValue,
        pad_batch,
        padder,
    )
    from .dataset import CheckpointableDataset, PipelineFactory, reader_identity
    from .loader_state import resize_loader_state
    from .packed import PackedBatch, collate_packed

__all__ = [
    "CheckpointableDataset",
    "PackedBatch",
    "PadOptions",
    "PadValue",
    "PaddedArrays",
    "PaddedArraysNoMask",
    "PaddedTensors",
    "PaddedTensorsNoMask",
    "PipelineFactory",
    "collate_packed",
    "pad_batch",
    "padder",
    "reader_identity",
    "resize_loader_state",
]

_NEEDS_TORCH = {"CheckpointableDataset", "PipelineFactory", "reader_identity"}
_LOADER_STATE = {"resize_loader_state"}
_NEEDS_NUMPY = {
    "PadOptions",
    "PadValue",
    "PaddedArrays",
    "PaddedArraysNoMask",
    "PaddedTensors",
    "PaddedTensorsNoMask",
    "pad_batch",
    "padder",
}
_PACKED = {"PackedBatch", "collate_packed"}


def __getattr__(name: str) -> Any:
    # Imports torch or numpy on first use of a name that needs it (PEP 562).
    if name in _NEEDS_TORCH:
        from . import dataset

        return getattr(dataset, name)
    if name in _LOADER_STATE:
        from . import loader_state

        return getattr(loader_state, name)
    if name in _PACKED:
        from . import packed

        return getattr(packed, name)
    if name in _NEEDS_NUMPY:
        from . import collate

        return getattr(collate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
