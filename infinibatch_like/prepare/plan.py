"""Planning a chunking job: inputs resolved into pieces, the job's identity, chunk names.

A *piece* is the unit of work that one process (or one Dask task) does alone: an input
file, a byte range of a large uncompressed local file, or a run of at most
`items_per_chunk` files of a directory input. Chunks never straddle pieces: a piece of n
items is cut into ``ceil(n / items_per_chunk)`` chunks of sizes differing by one item at
most (`chunk_sizes`: no short remainder that would unbalance shards), named
``chunk-PPPPPP-KKKKKK`` after the piece number P and the chunk's number K within it. The
plan depends only on the inputs and the arguments, never on the number of workers, so the
output is the same byte for byte however the pieces are scheduled, and a piece can be
redone alone.

Byte ranges: a piece of ``[start, end)`` of a file holds the lines that *begin* in that
range (a line beginning before `start` belongs to the previous piece), so every line is
in exactly one piece and no piece needs to read another's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

from ..io._compression import codec_for
from ..io._store import Store
from ..io._walk import walk_files
from ..io.webdataset import split_name
from ..stages.bad_records import SkipPolicy
from ._refs import is_url

COMPRESSIONS = {"gz": ".gz", "zst": ".zst", "none": ""}
"""``--compress`` values and the suffix they give the chunk files."""
INPUT_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
TEXT_SUFFIXES = ("", ".txt", ".text", ".tsv", ".csv")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
KINDS = ("lines", "jsonl", "files", "wds")
CHUNK_SUFFIXES = {"lines": ".txt", "jsonl": ".jsonl", "files": ".rec", "wds": ".tar"}
DEFAULT_SPLIT_BYTES = 64 << 20


@dataclass(frozen=True)
class Piece:
    """One unit of work (see the module's documentation)."""

    number: int
    source: str
    """The input file (lines, jsonl) or the directory (files)."""
    start: int = 0
    """The first byte of a byte range; 0 for a whole file."""
    end: int | None = None
    """The end of a byte range; None for a whole file (or a directory's files)."""
    names: tuple[str, ...] = ()
    """For a directory piece: the files' paths relative to `source` (``/``-separated); for
    WebDataset shards, those of its samples' files, sample by sample."""
    size: int | None = None
    """Bytes of input this piece reads, where known (for the progress bar)."""


@dataclass(frozen=True)
class Source:
    """An input file as the job found it: a re-run must find it the same to continue.

    The `version` is the file's modification time in nanoseconds for a local file (every
    write through the operating system sets it, so an edit that keeps the size is seen
    without reading the file again; only a deliberate reset of the time, ``touch -r``,
    hides one), and for an object its ETag (or the store's equivalent), which changes with
    the content.
    """

    name: str
    size: int
    version: str

    def to_json(self) -> list[Any]:
        return [self.name, self.size, self.version]


def source_of(ref: str, store: Store, listed: Mapping[str, Any] | None = None) -> Source:
    """The `Source` of input file `ref`: one ``stat``; for an object, what its listing
    said (`listed`), else one request to the store."""
    if not is_url(ref):
        status = os.stat(ref)
        return Source(ref, status.st_size, f"mtime_ns {status.st_mtime_ns}")
    info: Mapping[str, Any] = listed or {}
    if info.get("size") is None or not any(info.get(k) is not None for k in _VERSION_KEYS):
        info = store.info(ref)
    key = next((k for k in _VERSION_KEYS if info.get(k) is not None), None)
    return Source(ref, int(info["size"]), "" if key is None else f"{key} {info[key]}")


_VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "LastModified", "mtime")


def describe_changes(recorded: object, sources: list[Source]) -> list[str]:
    """What differs between the sources `recorded` in a job file and `sources`: each input
    changed, added or gone (at most 5 of each); ValueError if `recorded` is malformed."""
    if not isinstance(recorded, list) or not all(
        isinstance(item, list)
        and len(item) == 3
        and isinstance(item[0], str)
        and isinstance(item[1], int)
        and isinstance(item[2], str)
        for item in recorded
    ):
        raise ValueError("its 'sources' is not a list of [name, bytes, version]")
    before = {name: (size, version) for name, size, version in recorded}
    now = {source.name: (source.size, source.version) for source in sources}
    changed = [
        f"the input {name!r} changed since the job started ({before[name][0]} bytes, "
        f"{before[name][1]} there; {size} bytes, {version} now)"
        for name, (size, version) in now.items()
        if name in before and before[name] != (size, version)
    ]
    added = [f"the input {name!r} was added" for name in now if name not in before]
    gone = [f"the input {name!r} is gone" for name in before if name not in now]
    return [line for group in (changed, added, gone) for line in _first(group)]


def _first(lines: list[str], most: int = 5) -> list[str]:
    return lines[:most] + ([f"{len(lines) - most} more such"] if len(lines) > most else [])


@dataclass(frozen=True)
class Job:
    """What decides a job's output: a re-run must match it to continue."""

    kind: str
    inputs: tuple[str, ...]
    items_per_chunk: int
    compress: str
    split_bytes: int
    plan: str
    """SHA-256 of the pieces (input files, byte ranges, directory files) and of the
    `Source` of every input file."""
    on_error: str | dict[str, int | None] = "raise"
    """What a bad input line does: ``"raise"``, or the fields of the `SkipPolicy` that
    skips it (``{"max_skips": m, "per_items": n}``)."""
    chunk_sizes: str = "even"
    """How a piece's items are cut into chunks: ``"even"`` (see `chunk_sizes`). Recorded so
    that an output written with an earlier layout (full chunks and a short last one) is
    refused rather than finished with chunks of another size."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"] = list(self.inputs)
        return data

    def skip_policy(self) -> SkipPolicy | None:
        """The policy of `on_error` (None for ``"raise"``)."""
        if not isinstance(self.on_error, dict):
            return None
        return SkipPolicy(cast(int, self.on_error["max_skips"]), self.on_error["per_items"])

    def chunk_name(self, piece: int, number: int) -> str:
        """The file name of chunk `number` of piece `piece`."""
        suffix = CHUNK_SUFFIXES[self.kind] + COMPRESSIONS[self.compress]
        return f"chunk-{piece:06d}-{number:06d}{suffix}"


def chunk_sizes(items: int, items_per_chunk: int) -> list[int]:
    """The sizes of the chunks of a piece of `items` items: ``ceil(items / items_per_chunk)``
    sizes differing by one at most, the larger ones first."""
    count = -(-items // items_per_chunk)
    small, larger = divmod(items, count) if count else (0, 0)
    return [small + 1] * larger + [small] * (count - larger)


def piece_of(chunk_name: str) -> int:
    """The piece number in a chunk's file name (-1 for a name `Job.chunk_name` never gives)."""
    digits = chunk_name[len("chunk-") : len("chunk-000000")]
    return int(digits) if digits.isdigit() else -1


def input_kind(ref: str, fmt: str) -> str:
    """``"lines"`` or ``"jsonl"`` for an input file, from its suffix (``fmt="auto"``) or
    from `fmt`; raises ValueError for an unsupported compression suffix, or (with
    ``fmt="auto"``) a suffix that is neither text nor JSON lines."""
    try:
        codec_for(ref)
    except ValueError as error:
        raise ValueError(f"chunk: input {error}") from None
    name = ref.rstrip("/").rsplit("/", 1)[-1]
    stem = name
    for suffix in INPUT_COMPRESSIONS:
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
    inner = os.path.splitext(stem)[1].lower()
    if fmt != "auto":
        return fmt
    if inner in JSONL_SUFFIXES:
        return "jsonl"
    if inner in TEXT_SUFFIXES:
        return "lines"
    raise ValueError(
        f"chunk: input {ref!r} has the unsupported suffix {inner!r}: chunk reads text lines "
        f"({', '.join(s for s in TEXT_SUFFIXES if s)} or none) and JSON lines "
        f"({', '.join(JSONL_SUFFIXES)}), each optionally compressed "
        f"({', '.join(INPUT_COMPRESSIONS)}), and directories of files; pass --format lines "
        "or --format jsonl to read it anyway"
    )


def plain_local(ref: str) -> bool:
    """Whether `ref` is an uncompressed local file (which can be split into byte ranges)."""
    return not is_url(ref) and not ref.endswith(INPUT_COMPRESSIONS)


def line_pieces(sources: list[Source], split_bytes: int) -> list[Piece]:
    """The pieces of line inputs: each file whole, or in byte ranges of `split_bytes` where
    it is an uncompressed local file larger than that."""
    pieces: list[Piece] = []
    for source in sources:
        ref, size = source.name, source.size
        if plain_local(ref) and size > split_bytes:
            for start in range(0, size, split_bytes):
                end = min(size, start + split_bytes)
                pieces.append(Piece(len(pieces), ref, start, end, size=end - start))
        else:
            pieces.append(Piece(len(pieces), ref, size=size))
    return pieces


def directory_files(directory: str, leave_out: str | None = None) -> list[str]:
    """The files of a directory input, recursively, as sorted ``/``-separated paths relative
    to it; linked directories are entered once (loops are not followed), and the directory
    `leave_out` (the job's output, if it lies inside) is not entered."""
    skipped = None if leave_out is None else os.path.realpath(leave_out)

    def descend(parts: tuple[str, ...]) -> bool:
        return skipped is None or os.path.realpath(os.path.join(directory, *parts)) != skipped

    return sorted("/".join(parts) for parts in walk_files(directory, descend))


def file_pieces(directory: str, files: list[tuple[str, int]], items_per_chunk: int) -> list[Piece]:
    """The pieces of a directory input whose files are `files` (each a `directory_files`
    path and its size), at most `items_per_chunk` to a piece, in pieces of `chunk_sizes`."""
    pieces: list[Piece] = []
    start = 0
    for count in chunk_sizes(len(files), items_per_chunk):
        group = files[start : start + count]
        start += count
        names = tuple(name for name, _ in group)
        pieces.append(Piece(len(pieces), directory, names=names, size=sum(s for _, s in group)))
    return pieces


def sample_pieces(
    directory: str, files: list[tuple[str, int]], samples_per_chunk: int
) -> list[Piece]:
    """The pieces of a directory input written as WebDataset shards: its files (each a
    `directory_files` path and its size) grouped into samples by key (the path up to the
    first dot of the base name), samples in key order and a sample's files in extension
    order, at most `samples_per_chunk` samples to a piece, in pieces of `chunk_sizes`.

    Raises:
        ValueError: for a file without an extension, naming it.
    """
    samples: dict[str, list[tuple[str, str, int]]] = {}
    for name, size in files:
        key, extension = split_name(name)
        if extension is None:
            raise ValueError(
                f"chunk: the file {name!r} in {directory!r} has no extension: WebDataset "
                "shards hold samples of files named KEY.EXTENSION (e.g. 0001.jpg, 0001.json)"
            )
        samples.setdefault(key, []).append((extension, name, size))
    keys = sorted(samples)
    pieces: list[Piece] = []
    start = 0
    for count in chunk_sizes(len(keys), samples_per_chunk):
        group = [sorted(samples[key]) for key in keys[start : start + count]]
        start += count
        names = tuple(name for sample in group for _, name, _ in sample)
        size = sum(size for sample in group for _, _, size in sample)
        pieces.append(Piece(len(pieces), directory, names=names, size=size))
    return pieces


def plan_digest(pieces: list[Piece], sources: list[Source]) -> str:
    """A SHA-256 of the pieces and sources: equal plans give equal digests on every machine."""
    digest = hashlib.sha256()
    for item in [*map(asdict, pieces), *(source.to_json() for source in sources)]:
        digest.update(json.dumps(item, sort_keys=True).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()
