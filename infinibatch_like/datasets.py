"""infinibatch-compatible datasets: `chunked_dataset_iterator` and `bump_seed`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._base import CheckpointableIterator
from .flatten import SelectManyIterator
from .mapping import MapIterator
from .prefetch import PrefetchIterator
from .shuffle import BlockwiseShuffleIterator, BufferedShuffleIterator
from .sources import create_source_iterator


def bump_seed(seed: int | None, step: int = 1) -> int | None:
    """The seed for a pipeline's next random stage: None stays None, else ``seed + 1``.

    `step` is accepted and ignored, exactly as in infinibatch 0.1.1 (so that the same
    arguments give the same data).
    """
    return None if seed is None else seed + 1


def chunked_dataset_iterator(
    chunk_refs: Sequence[Any],
    read_chunk_fn: Callable[[Any], Iterable[Any]],
    buffer_size: int,
    train: bool = True,
    seed: int | None = None,
    shuffle: bool = True,
    use_windowed: bool = False,
    transform: Callable[[Any], Any] | None = None,
    prefetch: bool = False,
    num_instances: int = 1,
    instance_rank: int = 0,
    *,
    read_ahead_chunks: int = 0,
) -> CheckpointableIterator[Any]:
    """Items of a corpus split into chunks (e.g. files), read chunk by chunk and shuffled.

    Composes, in order: `create_source_iterator` over `chunk_refs` (training: endless
    passes, chunks reshuffled every pass and strided over ranks; evaluation, ``train=False``
    with ``shuffle=False``: one ordered pass over this rank's contiguous share), a
    `SelectManyIterator` calling ``read_chunk_fn(chunk_ref)`` (with ``read_ahead_chunks=n``,
    the next `n` chunks are read and decompressed in background threads, so
    `read_chunk_fn` must be thread-safe), with `shuffle` a `BlockwiseShuffleIterator` of
    `buffer_size` items (a `BufferedShuffleIterator` if `use_windowed`) seeded with
    ``bump_seed(seed)``, and with `transform` a `MapIterator`.

    With `prefetch`, a `PrefetchIterator` of `buffer_size` items (a worker process) reads
    the chunks and runs the blockwise shuffle ahead of the consumer, so that a restore
    sends only the items the consumer takes, not a whole block. With `use_windowed` it
    sits before the windowed shuffle instead, whose state holds its whole buffer (too
    much to snapshot every 100 items). The items are the same either way.

    Checkpoint:
        That of the composed chain: constant size (no items unless `use_windowed`); a
        restore re-reads the current chunk and, with shuffling, the current block.
    """
    if not train and shuffle:
        raise ValueError("chunked_dataset_iterator: shuffle=True is not supported when train=False")
    samples: CheckpointableIterator[Any] = SelectManyIterator(
        create_source_iterator(
            chunk_refs,
            train=train,
            seed=seed,
            shuffle=shuffle,
            num_instances=num_instances,
            instance_rank=instance_rank,
        ),
        read_chunk_fn,
        read_ahead=read_ahead_chunks,
    )
    if prefetch and use_windowed:
        samples = PrefetchIterator(samples, buffer_size)
    if shuffle:
        shuffle_stage = BufferedShuffleIterator if use_windowed else BlockwiseShuffleIterator
        samples = shuffle_stage(samples, buffer_size, bump_seed(seed))
    if prefetch and not use_windowed:
        samples = PrefetchIterator(samples, buffer_size)
    if transform is not None:
        samples = MapIterator(samples, transform)
    return samples
