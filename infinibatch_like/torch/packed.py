"""Collating packed sequences (`infinibatch_like.stages.packing`) into torch tensors with masks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._core.extras import missing_extra

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100
"""The label of positions without a next token in their document (torch's cross-entropy
default ``ignore_index``)."""

_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask", "cu_seqlens")


class PackedBatch(NamedTuple):
    """A batch of packed sequences as CPU tensors.

    Attributes:
        tokens: int64 ``(batch, seq_len)``.
        labels: int64 ``(batch, seq_len)``: the next token of the same document piece, or
            `IGNORE_INDEX` at a piece's last token and on padding (next-token targets).
        segment_ids: int32 ``(batch, seq_len)``: 1, 2, ... per piece in each row, 0 on
            padding; tokens attend to tokens of equal (nonzero) segment id.
        positions: int64 ``(batch, seq_len)``, restarting at 0 for each piece.
        loss_mask: bool ``(batch, seq_len)``: True on document tokens.
        cu_seqlens: int32 ``(segments + 1,)``: the boundaries of every piece (padding
            included as a piece) over the batch flattened to ``batch * seq_len`` tokens, as
            varlen attention kernels take them (e.g. ``flash_attn_varlen_func``).
        max_seqlen: the longest piece, for those kernels.
        origins: int64 ``(pieces, 5)`` for sequences packed with ``traced=True``: each
            piece's row, first and end token in the row, origin and offset in its document
            (see `infinibatch_like.stats.lineage`); else None.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    segment_ids: torch.Tensor
    positions: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    origins: torch.Tensor | None = None

    def pin_memory(self) -> PackedBatch:
        """The same batch in page-locked memory (needs an accelerator)."""
        return self._map(lambda tensor: tensor.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The same batch on `device`, e.g. ``batch.to("cuda", non_blocking=True)``."""
        return self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> PackedBatch:
        return PackedBatch(
            move(self.tokens),
            move(self.labels),
            move(self.segment_ids),
            move(self.positions),
            move(self.loss_mask),
            move(self.cu_seqlens),
            self.max_seqlen,
            None if self.origins is None else move(self.origins),
        )


def collate_packed(sequences: Sequence[Mapping[str, Any]]) -> PackedBatch:
    """Stack packed sequences (`infinibatch_like.stages.packing.PackedSequence` dicts, all of one
    `seq_len`) into a `PackedBatch`; use it as a DataLoader's ``collate_fn`` or in a
    `MapIterator` after a `FixedBatchIterator`.

    Raises:
        ValueError: for an empty batch, a sequence lacking a field, or sequences of
            different lengths, naming the sequence.
    """
    try:
        import numpy as np
        import torch
    except ModuleNotFoundError as error:
        raise missing_extra(
            error.name or "torch", "torch", "infinibatch_like.torch.collate_packed"
        ) from error
    if not sequences:
        raise ValueError("collate_packed: the batch is empty")
    seq_len = None
    for index, sequence in enumerate(sequences):
        missing = [field for field in _FIELDS if field not in sequence]
        if missing:
            raise ValueError(
                f"collate_packed: sequence {index} lacks {missing}; expected PackingIterator's "
                f"items (dicts with {list(_FIELDS)})"
            )
        length = len(sequence["tokens"])
        seq_len = length if seq_len is None else seq_len
        if length != seq_len:
            raise ValueError(
                f"collate_packed: sequence {index} has {length} tokens, sequence 0 has {seq_len}"
            )
    assert seq_len is not None
    tokens = np.stack([sequence["tokens"] for sequence in sequences]).astype(np.int64)
    segments = np.stack([sequence["segment_ids"] for sequence in sequences]).astype(np.int32)
    labels = np.full_like(tokens, IGNORE_INDEX)
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    labels[:, :-1] = np.where(same, tokens[:, 1:], IGNORE_INDEX)
    bounds = [np.asarray(sequence["cu_seqlens"], dtype=np.int64) for sequence in sequences]
    flat = np.concatenate(
        [[0]] + [row[1:] + index * seq_len for index, row in enumerate(bounds)]
    ).astype(np.int32)
    return PackedBatch(
        tokens=torch.from_numpy(tokens),
        labels=torch.from_numpy(labels),
        segment_ids=torch.from_numpy(segments),
        positions=torch.from_numpy(
            np.stack([sequence["positions"] for sequence in sequences]).astype(np.int64)
        ),
        loss_mask=torch.from_numpy(
            np.stack([sequence["loss_mask"] for sequence in sequences]).astype(np.bool_)
        ),
        cu_seqlens=torch.from_numpy(flat),
        max_seqlen=int(np.diff(flat).max()),
        origins=_origins(sequences, torch, np),
    )


def _origins(sequences: Sequence[Mapping[str, Any]], torch: Any, np: Any) -> Any:
    """The rows of `PackedBatch.origins`, or None if the sequences are not traced."""
    if not all("origins" in sequence for sequence in sequences):
        return None
    rows = []
    for row, sequence in enumerate(sequences):
        origins = np.asarray(sequence["origins"], dtype=np.int64).reshape(-1, 2)
        bounds = np.asarray(sequence["cu_seqlens"], dtype=np.int64)[: len(origins) + 1]
        count = len(origins)
        rows.append(np.column_stack([np.full(count, row), bounds[:-1], bounds[1:], origins]))
    return torch.from_numpy(np.concatenate(rows).astype(np.int64))
