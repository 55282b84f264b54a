"""The chunk index: what ``python -m infinibatch_like chunk`` wrote, read back with
`load_index`, and the epoch arithmetic it allows without reading any data.

``index.json`` (next to the chunks) holds the format and its version, the job that wrote
it (inputs, items per chunk, compression: a re-run with other arguments is refused) and,
in stream order, every chunk's file name, item count, stored size in bytes and the
SHA-256 of its decompressed content.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core.checks import require_int
from ..io._store import StorageOptions, Store
from ..io.retry import RetryPolicy
from ..stages.sources import ChunkedSourceIterator, InfinitePermutationSourceIterator, check_rank
from ._files import file_names, load_json, read_bytes
from ._refs import is_url, join_ref
from .balancing import balanced_shards
from .plan import COMPRESSIONS, KINDS

INDEX_NAME = "index.json"
FORMAT = "infinibatch_like.chunk_index"
VERSION = 1


class ChunkIndexError(ValueError):
    """An index that cannot be used: unreadable, of another format, or not matching the
    chunk files next to it."""


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk of an index: its file name (relative to the index), its number of items,
    its stored size in bytes and the SHA-256 (hex) of its decompressed content."""

    name: str
    items: int
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """The chunk's entry in the index file."""
        return {"name": self.name, "items": self.items, "bytes": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class ChunkIndex:
    """The chunks of a prepared corpus, in stream order, and the job that wrote them.

    ``len(index)`` is the number of items; `chunk_refs` are the chunk references to give
    `chunked_dataset_iterator` (with the reader that fits `kind`: ``read_lines``,
    ``read_jsonl``, ``read_records`` or ``read_webdataset`` of `infinibatch_like.io`).
    `items_per_epoch` and `batches_per_epoch` answer, from the item counts alone, how much
    data a rank sees; `shards` splits the chunks into shards of nearly equal item counts (for a
    `ShardedIterator`).
    """

    location: str
    """The directory or URL that holds the index and its chunks."""
    job: dict[str, Any]
    """The arguments of the job that wrote the chunks (see ``chunk --help``)."""
    chunks: tuple[ChunkEntry, ...]
    skipped: int = 0
    """How many bad input lines the job skipped (``chunk --skip-bad-lines``)."""
    skip_examples: tuple[str, ...] = ()
    """The first few of them, described (input, line number, what is wrong)."""

    def __len__(self) -> int:
        return sum(chunk.items for chunk in self.chunks)

    @property
    def kind(self) -> str:
        """``"lines"``, ``"jsonl"``, ``"files"`` (records packed with ``write_records``) or
        ``"wds"`` (WebDataset tar shards, read with ``read_webdataset``)."""
        return str(self.job["kind"])

    @property
    def chunk_refs(self) -> list[str]:
        """The chunk references (paths or URLs) in stream order."""
        return [join_ref(self.location, chunk.name) for chunk in self.chunks]

    def shards(self, num_shards: int) -> list[list[str]]:
        """The chunk references of each of `num_shards` shards, balanced by item count:
        ``balanced_shards(zip(index.chunk_refs, items), num_shards)`` (see there: the same
        on every rank, each chunk in exactly one shard, shards differing by at most the
        largest chunk's count). Use it instead of a stride
        (``chunk_refs[shard::num_shards]``), which gives shards as unequal as the chunks
        that fall to them.

        Raises:
            TypeError, ValueError: for a `num_shards` that is not an int >= 1.
        """
        require_int("ChunkIndex.shards", "num_shards", num_shards, 1)
        counts = [chunk.items for chunk in self.chunks]
        return balanced_shards(zip(self.chunk_refs, counts, strict=True), num_shards)

    def rank_chunks(
        self,
        num_instances: int = 1,
        instance_rank: int = 0,
        *,
        train: bool = True,
        shuffle: bool = True,
        seed: int | None = None,
        epoch: int = 0,
    ) -> list[int]:
        """The positions in `chunks` that rank `instance_rank` of `num_instances` reads in
        pass `epoch` of ``chunked_dataset_iterator(index.chunk_refs, ...)`` with these
        arguments (the same names and meanings), in reading order.

        Training streams the chunk list pass after pass (reshuffled per pass with
        `shuffle`), rank r taking the positions r, r + n, ... of that stream: pass e is
        the stream positions ``e * len(chunks)`` to ``(e + 1) * len(chunks) - 1``, and each
        of them goes to exactly one rank. Evaluation (``train=False``) is one pass over a
        contiguous share per rank; `epoch` must be 0 there.

        Raises:
            ValueError: for a bad rank or epoch, ``train=False`` with `shuffle`, and
                ``seed=None`` where the shuffled chunk order decides the answer (training,
                shuffled, more than one rank and chunks of unequal sizes).
        """
        owner = "ChunkIndex.rank_chunks"
        check_rank(owner, num_instances, instance_rank)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"{owner}: epoch must be an int >= 0, got {epoch!r}")
        positions = range(len(self.chunks))
        if not train:
            if shuffle:
                raise ValueError(f"{owner}: shuffle=True is not supported when train=False")
            if epoch != 0:
                raise ValueError(f"{owner}: evaluation (train=False) has one pass, got {epoch=}")
            return list(ChunkedSourceIterator(positions, num_instances, instance_rank))
        if shuffle and seed is None and num_instances > 1:
            if len({chunk.items for chunk in self.chunks}) > 1:
                raise ValueError(
                    f"{owner}: with shuffle=True and seed=None the chunk order is random, so "
                    "the items per rank are unknown: pass the seed the pipeline uses"
                )
            shuffle = False  # equal chunks: any order gives each rank the same count
        length = len(self.chunks)
        first, last = epoch * length, (epoch + 1) * length  # stream positions of the pass
        before = _count_congruent(0, first, instance_rank, num_instances)
        count = _count_congruent(first, last, instance_rank, num_instances)
        source = InfinitePermutationSourceIterator(
            positions,
            seed=0 if seed is None else seed,
            shuffle=shuffle,
            num_instances=num_instances,
            instance_rank=instance_rank,
        )
        for _ in range(before):
            next(source)
        return [next(source) for _ in range(count)]

    def items_per_epoch(
        self,
        num_instances: int = 1,
        instance_rank: int = 0,
        *,
        train: bool = True,
        shuffle: bool = True,
        seed: int | None = None,
        epoch: int = 0,
    ) -> int:
        """The number of items rank `instance_rank` reads in pass `epoch` (see
        `rank_chunks` for the arguments and errors)."""
        chosen = self.rank_chunks(
            num_instances, instance_rank, train=train, shuffle=shuffle, seed=seed, epoch=epoch
        )
        return sum(self.chunks[position].items for position in chosen)

    def batches_per_epoch(
        self,
        batch_size: int,
        num_instances: int = 1,
        instance_rank: int = 0,
        *,
        drop_last: bool = False,
        train: bool = True,
        shuffle: bool = True,
        seed: int | None = None,
        epoch: int = 0,
    ) -> int:
        """The number of `batch_size` batches (``FixedBatchIterator``) that the items of
        `items_per_epoch` fill: the last one partial, or left out with `drop_last`."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"ChunkIndex.batches_per_epoch: batch_size must be an int >= 1, got {batch_size!r}"
            )
        items = self.items_per_epoch(
            num_instances, instance_rank, train=train, shuffle=shuffle, seed=seed, epoch=epoch
        )
        return items // batch_size if drop_last else -(-items // batch_size)

    def to_json(self) -> dict[str, Any]:
        """The index file's content."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "job": self.job,
            "items": len(self),
            "chunks": [chunk.to_json() for chunk in self.chunks],
            "skipped": {"lines": self.skipped, "first": list(self.skip_examples)},
        }


def _count_congruent(start: int, stop: int, residue: int, modulus: int) -> int:
    """How many p in ``range(start, stop)`` have ``p % modulus == residue``."""

    def upto(bound: int) -> int:  # how many p in range(0, bound)
        return max(0, -(-(bound - residue) // modulus))

    return upto(stop) - upto(start)


def parse_index(location: str, data: bytes | str) -> ChunkIndex:
    """The `ChunkIndex` in `data` (an index file's content) for chunks under `location`.

    Raises:
        ChunkIndexError: naming the index and what is wrong with it.
    """
    where = join_ref(location, INDEX_NAME)
    try:
        content = load_json(data, f"chunk index {where}")
    except ValueError as error:
        raise ChunkIndexError(str(error)) from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ChunkIndexError(f"{where} is not a chunk index (no 'format': {FORMAT!r})")
    if content.get("version") != VERSION:
        raise ChunkIndexError(
            f"chunk index {where} has format version {content.get('version')!r}; this version "
            f"of infinibatch_like reads version {VERSION}"
        )
    try:
        if not isinstance(content.get("chunks"), list):
            raise ValueError("'chunks' is not a list")
        chunks = tuple(entry_from_json(raw) for raw in content["chunks"])
        job, items = _job(content.get("job")), content.get("items")
        skipped, examples = _skipped(content.get("skipped", {"lines": 0, "first": []}))
    except ValueError as error:
        raise ChunkIndexError(f"chunk index {where} is damaged: {error}") from None
    index = ChunkIndex(location, job, chunks, skipped, examples)
    if items != len(index):
        raise ChunkIndexError(
            f"chunk index {where} is damaged: it says {items} items, its chunks hold {len(index)}"
        )
    names = [chunk.name for chunk in chunks]
    if len(set(names)) != len(names):
        raise ChunkIndexError(f"chunk index {where} is damaged: it lists a chunk twice")
    return index


def _job(job: object) -> dict[str, Any]:
    """`job` checked: the fields that `Job` writes, of their types (ValueError naming one)."""
    if not isinstance(job, dict):
        raise ValueError("'job' is not an object")
    for field, valid, meaning in (
        ("kind", lambda v: v in KINDS, f"one of {', '.join(map(repr, KINDS))}"),
        ("items_per_chunk", _count, "an int >= 1"),
        ("split_bytes", _count, "an int >= 1"),
        ("compress", lambda v: v in COMPRESSIONS, f"one of {', '.join(map(repr, COMPRESSIONS))}"),
        ("plan", lambda v: isinstance(v, str), "a string"),
        (
            "inputs",
            lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
            "a list of strings",
        ),
    ):
        if field not in job:
            raise ValueError(f"'job' has no {field!r}")
        if not valid(job[field]):
            raise ValueError(f"'job' has the {field!r} {job[field]!r} (not {meaning})")
    on_error = job.get("on_error", "raise")  # absent from the indexes of earlier versions
    if on_error != "raise" and not (
        isinstance(on_error, dict)
        and set(on_error) == {"max_skips", "per_items"}
        and all(v is None or isinstance(v, int) for v in on_error.values())
    ):
        raise ValueError(f"'job' has the 'on_error' {on_error!r} (not 'raise' or a SkipPolicy's)")
    return job


def _skipped(raw: object) -> tuple[int, tuple[str, ...]]:
    """The count and examples of an index's ``"skipped"`` (ValueError if malformed)."""
    lines = raw.get("lines") if isinstance(raw, dict) else None
    first = raw.get("first") if isinstance(raw, dict) else None
    if isinstance(lines, bool) or not isinstance(lines, int) or lines < 0:
        raise ValueError(f"'skipped' has the 'lines' {lines!r} (not an int >= 0)")
    if not isinstance(first, list) or not all(isinstance(line, str) for line in first):
        raise ValueError("'skipped' has no list of strings 'first'")
    return lines, tuple(first)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def entry_from_json(raw: object) -> ChunkEntry:
    """The `ChunkEntry` of an index (or piece manifest) entry; ValueError naming the field."""
    if not isinstance(raw, dict):
        raise ValueError(f"the chunk entry {str(raw)[:80]!r} is not an object")
    absent = [field for field in ("name", "items", "bytes", "sha256") if field not in raw]
    if absent:
        raise ValueError(f"the chunk entry {str(raw)[:80]!r} has no {absent[0]!r}")
    name, items, size, digest = raw["name"], raw["items"], raw["bytes"], raw["sha256"]
    if not (isinstance(name, str) and name and "/" not in name):
        raise ValueError(f"bad chunk name {name!r}")
    for field, value in (("items", items), ("bytes", size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"chunk {name}: bad {field!r} {value!r}")
    if not isinstance(digest, str) or len(digest) != 64:
        raise ValueError(f"chunk {name}: bad 'sha256' {digest!r}")
    return ChunkEntry(name, items, size, digest)


def missing_and_unlisted(index: ChunkIndex, present: Sequence[str]) -> tuple[list[str], list[str]]:
    """The index's chunk names absent from `present` (file names found next to it), and
    the chunk files present that the index does not list."""
    listed = {chunk.name for chunk in index.chunks}
    found = set(present)
    missing = [chunk.name for chunk in index.chunks if chunk.name not in found]
    unlisted = sorted(found - listed)
    return missing, unlisted


def load_index(
    dir_or_url: str,
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> ChunkIndex:
    """The index that ``python -m infinibatch_like chunk`` wrote in `dir_or_url`.

    The chunk files next to it must be those it lists (one listing, no data read; local
    chunks must also have their recorded sizes): ``verify`` checks their content.

    Args:
        dir_or_url: the job's output directory or URL.
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkIndexError: if there is no index (or the job that writes it has not finished),
            if it is damaged or of another version, or if it does not match the chunk files
            (naming the missing and the unlisted ones).
    """
    store = Store.of(storage_options, retry)
    index = index_in(dir_or_url, store)
    location, where = index.location, join_ref(index.location, INDEX_NAME)
    present = chunk_names(location, store)
    missing, unlisted = missing_and_unlisted(index, present)
    if missing or unlisted:
        raise ChunkIndexError(
            f"load_index: the chunk index {where} does not match the chunk files next to it: "
            + "; ".join(
                f"{len(names)} {what} ({_some(names)})"
                for what, names in (("missing", missing), ("not in the index", unlisted))
                if names
            )
        )
    if not is_url(location):
        wrong = [
            f"{chunk.name} has {size} bytes, the index says {chunk.size}"
            for chunk in index.chunks
            if (size := os.path.getsize(os.path.join(location, chunk.name))) != chunk.size
        ]
        if wrong:
            raise ChunkIndexError(
                f"load_index: the chunk index {where} does not match its chunks: {_some(wrong)}"
            )
    return index


def read_index(
    dir_or_url: str,
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> ChunkIndex:
    """The index in `dir_or_url`, not compared with the chunk files (see `load_index`).

    Args:
        dir_or_url: the job's output directory or URL.
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkIndexError: if there is none, or it is damaged or of another version.
    """
    return index_in(dir_or_url, Store.of(storage_options, retry))


def index_in(dir_or_url: str, store: Store) -> ChunkIndex:
    """`read_index` of `dir_or_url` in `store`."""
    location = dir_or_url.rstrip("/") or dir_or_url
    where = join_ref(location, INDEX_NAME)
    try:
        data = read_bytes(where, store)
    except FileNotFoundError:
        bucket = store.missing_bucket(where)
        if bucket is not None:
            raise ChunkIndexError(f"no chunk index at {where}: {bucket}") from None
        raise ChunkIndexError(
            f"no chunk index at {where}: write one with `python -m infinibatch_like chunk "
            "INPUT... --out DIR` (an unfinished job has none yet: run it again to finish it)"
        ) from None
    return parse_index(location, data)


def chunk_names(location: str, store: Store) -> list[str]:
    """The names of the chunk files (``chunk-*``) in `location`; none if it has none."""
    return [name for name in file_names(location, store) if name.startswith("chunk-")]


def _some(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")
