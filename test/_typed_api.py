"""Type-checked, not run, by test_static.py: mypy --strict gives the public API's results
the types a user expects, without annotations at the call site."""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import assert_type  # typing has it from Python 3.11

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.iterators import (
    CheckpointableIterator,
    FixedBatchIterator,
    MapIterator,
    NativeCheckpointableIterator,
)
from infinibatch_like.torch import (
    PaddedArrays,
    PaddedArraysNoMask,
    PaddedTensors,
    PaddedTensorsNoMask,
    pad_batch,
    padder,
)


def read_chunk(path: str) -> list[list[int]]:
    return [[len(path)]]


# chunked_dataset_iterator keeps the item type of read_chunk_fn (and of transform).
tokens = chunked_dataset_iterator(["a.txt"], read_chunk, buffer_size=4, seed=1)
assert_type(tokens, CheckpointableIterator[list[int]])
assert_type(
    chunked_dataset_iterator(["a.txt"], read_chunk, 4, transform=len), CheckpointableIterator[int]
)
assert_type(
    chunked_dataset_iterator(["a.txt"], read_chunk, 4, True, 1, True, False, str),
    CheckpointableIterator[str],
)

# pad_batch: the result type follows `to` and `with_mask`; the default has a mask.
assert_type(pad_batch([[1, 2], [3]]), PaddedArrays)
assert_type(pad_batch([[1, 2], [3]]).mask, npt.NDArray[np.bool_])
assert_type(pad_batch([[1]], to="torch").mask, torch.Tensor)
assert_type(pad_batch([[1]], with_mask=False), PaddedArraysNoMask)
assert_type(pad_batch([[1]], to="torch", with_mask=False).mask, None)
values, lengths, mask = pad_batch([[1]], to="torch", pad_value=-1)
assert_type(mask, torch.Tensor)

# padder: a typed collate function or transform (functools.partial of the overloaded
# pad_batch is typed by its first overload, by mypy's design).
batches = FixedBatchIterator(tokens, 2)
assert_type(MapIterator(batches, padder(to="torch", pad_value=0)), MapIterator[PaddedTensors])
assert_type(MapIterator(batches, padder(with_mask=False)), MapIterator[PaddedArraysNoMask])
assert_type(padder(to="torch", with_mask=False)([[1]]), PaddedTensorsNoMask)
assert_type(functools.partial(pad_batch, pad_value=0)([[1]]), PaddedArrays)

# ShardedIterator: a lambda factory needs no annotations; the item type is inferred.
sharded = ShardedIterator(
    lambda shard, num_shards: NativeCheckpointableIterator([shard] * num_shards), 4, 0, 1
)
assert_type(sharded, ShardedIterator[int])
