"""infinibatch-compatible datasets: `chunked_dataset_iterator` and `bump_seed`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from math import gcd
from typing import Any, TypeVar, overload

from ._core.checks import require_callable, require_int
from ._core.names import short_repr
from ._core.protocol import CheckpointableIterator
from .stages.bad_records import OnError, resolve_on_error
from .stages.flatten import SelectManyIterator
from .stages.mapping import MapIterator
from .stages.prefetch import PrefetchIterator
from .stages.shuffle import BlockwiseShuffleIterator, BufferedShuffleIterator
from .stages.sources import (
    EVALUATION_HAS_NO_EPOCHS,
    check_epochs,
    check_rank,
    create_source_iterator,
)

_OWNER = "chunked_dataset_iterator"

R = TypeVar("R")
T = TypeVar("T")
U = TypeVar("U")


def bump_seed(seed: int | None, step: int = 1) -> int | None:
    """The seed for a pipeline's next random stage: None stays None, else ``seed + 1``.

    `step` is accepted and ignored, exactly as in infinibatch 0.1.1 (so that the same
    arguments give the same data).
    """
    return None if seed is None else seed + 1


@overload
def chunked_dataset_iterator(
    chunk_refs: Sequence[R],
    read_chunk_fn: Callable[[R], Iterable[T]],
    buffer_size: int,
    train: bool = True,
    seed: int | None = None,
    shuffle: bool = True,
    use_windowed: bool = False,
    transform: None = None,
    prefetch: bool = False,
    num_instances: int = 1,
    instance_rank: int = 0,
    *,
    read_ahead_chunks: int = 0,
    epochs: int | None = None,
    on_error: OnError = "raise",
) -> CheckpointableIterator[T]: ...


@overload
def chunked_dataset_iterator(
    chunk_refs: Sequence[R],
    read_chunk_fn: Callable[[R], Iterable[T]],
    buffer_size: int,
    train: bool = True,
    seed: int | None = None,
    shuffle: bool = True,
    use_windowed: bool = False,
    *,
    transform: Callable[[T], U],
    prefetch: bool = False,
    num_instances: int = 1,
    instance_rank: int = 0,
    read_ahead_chunks: int = 0,
    epochs: int | None = None,
    on_error: OnError = "raise",
) -> CheckpointableIterator[U]: ...


@overload
def chunked_dataset_iterator(
    chunk_refs: Sequence[R],
    read_chunk_fn: Callable[[R], Iterable[T]],
    buffer_size: int,
    train: bool,
    seed: int | None,
    shuffle: bool,
    use_windowed: bool,
    transform: Callable[[T], U],
    prefetch: bool = False,
    num_instances: int = 1,
    instance_rank: int = 0,
    *,
    read_ahead_chunks: int = 0,
    epochs: int | None = None,
    on_error: OnError = "raise",
) -> CheckpointableIterator[U]: ...


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
    epochs: int | None = None,
    on_error: OnError = "raise",
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

    With ``epochs=n`` (training only) the stream ends after n passes over the chunks,
    each in a fresh permutation: exactly the first n passes of the endless stream with the
    same arguments. Each rank reads the same chunks, in the same order, as the first part
    of its endless stream: from every pass, the chunks at the positions congruent to its
    rank modulo `num_instances` (so the ranks' shares of each pass are disjoint, cover all
    chunks and differ by at most one chunk). The items are those of the endless stream
    except the last at most `buffer_size`: the last, shorter shuffle block is shuffled on
    its own (with `use_windowed`, the buffer is emptied when the chunks end). Over all
    ranks, the stream holds every item of the corpus exactly n times.

    With `prefetch`, a `PrefetchIterator` of `buffer_size` items (a worker process) reads
    the chunks and runs the blockwise shuffle ahead of the consumer, so that a restore
    sends only the items the consumer takes, not a whole block. With `use_windowed` it
    sits before the windowed shuffle instead, whose state holds its whole buffer (too
    much to snapshot every 100 items). The items are the same either way.

    With ``on_error="skip"`` or ``on_error=SkipPolicy(...)`` (see
    `infinibatch_like.stages.bad_records`), the chunk reader skips records (and chunks) whose
    reading raises, and the `MapIterator` of `transform` the items it raises on, each stage within
    its own budget and with its own ledger (`infinibatch_like.stages.bad_records.skip_ledgers`).
    ``"raise"`` (default) changes nothing.

    Raises:
        TypeError, ValueError: for a bad argument, naming it (e.g. an empty `chunk_refs` in
            training, a `read_chunk_fn` that is not callable, `epochs` that is not an int
            >= 1, or `epochs` with ``train=False``, whose stream is one pass already).
        ValueError: from ``next()``, in endless training, once every chunk this rank can
            read has turned out empty (the endless passes would never yield an item). With
            ``shuffle=False`` a rank reads a fixed strided subset of the chunks; with
            shuffling, every chunk in time. With `epochs`, such a stream just ends.
        TypeError: from ``next()``, if `read_chunk_fn` returns a str or bytes.
        Exception: whatever reading a chunk raises, with a note naming the chunk; the
            items before it are delivered and the state points at the failing item.

    Checkpoint:
        That of the composed chain: constant size (no items unless `use_windowed`); a
        restore re-reads the current chunk and, with shuffling, the current block. With
        `epochs`, the same states as the endless stream (a state taken at or after the end
        restores to the end); `epochs` is recorded in the source's fingerprint, so a state
        taken with another `epochs` (or an endless one) is refused, naming it.
    """
    _check_arguments(
        chunk_refs, read_chunk_fn, buffer_size, train, seed, shuffle, transform, prefetch
    )
    check_rank(_OWNER, num_instances, instance_rank)
    require_int(_OWNER, "read_ahead_chunks", read_ahead_chunks, 0)
    check_epochs(_OWNER, epochs)
    if not train and epochs is not None:
        raise ValueError(f"{_OWNER}: {EVALUATION_HAS_NO_EPOCHS}, got epochs={epochs!r}")
    resolve_on_error(_OWNER, on_error)
    samples: CheckpointableIterator[Any] = SelectManyIterator(
        create_source_iterator(
            chunk_refs,
            train=train,
            seed=seed,
            shuffle=shuffle,
            num_instances=num_instances,
            instance_rank=instance_rank,
            epochs=epochs,
        ).label_arguments(
            {
                "source_items": f"{_OWNER}'s chunk_refs",
                "iterable": f"{_OWNER}'s chunk_refs (this rank's share)",
            }
        ),
        read_chunk_fn,
        read_ahead=read_ahead_chunks,
        selector_name=f"{_OWNER}'s read_chunk_fn",
        on_error=on_error,
        on_empty=_EmptyCorpusCheck(chunk_refs, shuffle, num_instances, instance_rank)
        if train and epochs is None
        else None,
    )
    if prefetch and use_windowed:
        samples = PrefetchIterator(samples, buffer_size)
    if shuffle:
        shuffle_stage = BufferedShuffleIterator if use_windowed else BlockwiseShuffleIterator
        size = "buffer_size" if use_windowed else "block_size"
        samples = shuffle_stage(samples, buffer_size, bump_seed(seed)).label_arguments(
            {size: f"{_OWNER}'s buffer_size"}
        )
    if prefetch and not use_windowed:
        samples = PrefetchIterator(samples, buffer_size)
    if transform is not None:
        samples = MapIterator(samples, transform, on_error=on_error)
    return samples


def _check_arguments(
    chunk_refs: object,
    read_chunk_fn: object,
    buffer_size: object,
    train: bool,
    seed: object,
    shuffle: bool,
    transform: object,
    prefetch: bool,
) -> None:
    """Raise TypeError/ValueError naming `chunked_dataset_iterator` and the bad argument."""
    if isinstance(chunk_refs, (str, bytes)) or not (
        hasattr(chunk_refs, "__len__") and hasattr(chunk_refs, "__getitem__")
    ):
        raise TypeError(
            f"{_OWNER}: chunk_refs must be a sequence of chunk references (e.g. a list of "
            f"file names), got {short_repr(chunk_refs)}"
        )
    if train and len(chunk_refs) == 0:
        raise ValueError(f"{_OWNER}: chunk_refs is empty; training (train=True) needs chunks")
    require_callable(_OWNER, "read_chunk_fn", read_chunk_fn)
    if shuffle or prefetch:
        require_int(_OWNER, "buffer_size", buffer_size, 1)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"{_OWNER}: seed must be an int or None, got {seed!r}")
    if transform is not None:
        require_callable(_OWNER, "transform", transform)
    if not train and shuffle:
        raise ValueError(f"{_OWNER}: shuffle=True is not supported when train=False")


def _chunk_key(chunk: Any) -> Hashable:
    return chunk if isinstance(chunk, Hashable) else (type(chunk).__name__, repr(chunk))


class _EmptyCorpusCheck:
    """Called with each chunk found empty in training; raises once every chunk this rank
    can ever read has been found empty (the endless passes would spin without an item).

    With ``shuffle=False`` rank r of n reads the positions r, r + n, ... of the repeated
    chunk list: the chunks whose index is r modulo ``gcd(n, len(chunk_refs))``. With
    shuffling, every pass is reshuffled, so every chunk reaches every rank in time. Costs
    one set insertion per empty chunk, nothing per item.
    """

    def __init__(
        self, chunk_refs: Sequence[Any], shuffle: bool, num_instances: int, instance_rank: int
    ) -> None:
        refs = list(chunk_refs)  # positions, as the source sees them (not labels)
        stride = 1 if shuffle else gcd(num_instances, len(refs))
        readable = range(instance_rank % stride, len(refs), stride)
        self._needed = len({_chunk_key(refs[index]) for index in readable})
        self._empty: set[Hashable] = set()
        if stride == 1:
            self._what = f"all {len(refs)} chunks in chunk_refs are empty"
        else:
            self._what = (
                f"the chunks of rank {instance_rank} of {num_instances} are all empty (with "
                f"shuffle=False this rank reads the {len(readable)} chunks at indices "
                f"{instance_rank % stride}, {instance_rank % stride + stride}, ... of "
                "chunk_refs)"
            )

    def __call__(self, chunk: Any) -> None:
        self._empty.add(_chunk_key(chunk))
        if len(self._empty) >= self._needed:
            raise ValueError(
                f"{_OWNER}: {self._what}: read_chunk_fn returned no items for any of them, "
                "so there are no items to train on"
            )
