"""collate_packed: packed sequences into tensors with labels, masks and varlen boundaries."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import infinibatch_like.iterators as it
from infinibatch_like import PackingIterator
from infinibatch_like.torch import PackedBatch, collate_packed


def packed(docs: list[list[int]], seq_len: int) -> list[dict[str, np.ndarray]]:
    return list(
        PackingIterator(it.NativeCheckpointableIterator(docs), seq_len, strategy="best_fit")
    )


def test_a_batch_has_next_token_labels_within_documents_and_flat_boundaries() -> None:
    batch = collate_packed(packed([[5, 6, 7], [8, 9], [10, 11, 12, 13]], 5))
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 0]]
    assert batch.labels.tolist() == [[6, 7, -100, 9, -100], [11, 12, 13, -100, -100]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch.loss_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 9, 10]
    assert batch.max_seqlen == 4
    dtypes = [batch.tokens.dtype, batch.labels.dtype, batch.segment_ids.dtype]
    assert dtypes == [torch.int64, torch.int64, torch.int32]
    assert batch.positions.dtype == torch.int64
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.loss_mask.dtype == torch.bool


def test_a_batch_moves_and_pickles_as_a_whole() -> None:
    batch = collate_packed(packed([[1, 2, 3, 4], [5]], 4))
    moved = batch.to("cpu")
    assert isinstance(moved, PackedBatch)
    assert moved.max_seqlen == batch.max_seqlen
    copy = pickle.loads(pickle.dumps(batch))
    assert all(torch.equal(a, b) for a, b in zip(copy[:6], batch[:6], strict=True))


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        ([], "collate_packed: the batch is empty"),
        ([{"tokens": np.zeros(3)}], "collate_packed: sequence 0 lacks"),
    ],
)
def test_bad_batches_are_refused_naming_the_sequence(sequences: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        collate_packed(sequences)


def test_sequences_of_different_lengths_are_refused() -> None:
    (short,) = packed([[1, 2]], 2)
    (long,) = packed([[1, 2, 3]], 3)
    with pytest.raises(ValueError, match="sequence 1 has 3 tokens, sequence 0 has 2"):
        collate_packed([short, long])
