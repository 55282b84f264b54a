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
from dataclasses import asdict, dataclass
from typing import Any

from ..io._compression import codec_for
from ._refs import is_url

COMPRESSIONS = {"gz": ".gz", "zst": ".zst", "none": ""}
"""``--compress`` values and the suffix they give the chunk files."""
INPUT_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
TEXT_SUFFIXES = ("", ".txt", ".text", ".tsv", ".csv")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
KINDS = ("lines", "jsonl", "files")
CHUNK_SUFFIXES = {"lines": ".txt", "jsonl": ".jsonl", "files": ".rec"}
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
    """For a directory piece: the files' paths relative to `source` (``/``-separated)."""
    size: int | None = None
    """Bytes of input this piece reads, where known (for the progress bar)."""


@dataclass(frozen=True)
class Job:
    """What decides a job's output: a re-run must match it to continue."""

    kind: str
    inputs: tuple[str, ...]
    items_per_chunk: int
    compress: str
    split_bytes: int
    plan: str
    """SHA-256 of the pieces (input files, their sizes, byte ranges, directory files)."""
    chunk_sizes: str = "even"
    """How a piece's items are cut into chunks: ``"even"`` (see `chunk_sizes`). Recorded so
    that an output written with an earlier layout (full chunks and a short last one) is
    refused rather than finished with chunks of another size."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"] = list(self.inputs)
        return data

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


def line_pieces(refs: list[str], split_bytes: int) -> list[Piece]:
    """The pieces of line inputs: each file whole, or in byte ranges of `split_bytes` where
    it is an uncompressed local file larger than that."""
    pieces: list[Piece] = []
    for ref in refs:
        size = os.path.getsize(ref) if not is_url(ref) else None
        if size is not None and plain_local(ref) and size > split_bytes:
            for start in range(0, size, split_bytes):
                end = min(size, start + split_bytes)
                pieces.append(Piece(len(pieces), ref, start, end, size=end - start))
        else:
            pieces.append(Piece(len(pieces), ref, size=size))
    return pieces


def file_pieces(directory: str, items_per_chunk: int) -> list[Piece]:
    """The pieces of a directory input: its files (recursively, sorted by relative path),
    at most `items_per_chunk` to a piece, in pieces of `chunk_sizes`."""
    names: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        relative = os.path.relpath(root, directory)
        for file in files:
            path = file if relative == "." else os.path.join(relative, file)
            names.append(path.replace(os.sep, "/"))
    names.sort()
    pieces: list[Piece] = []
    start = 0
    for count in chunk_sizes(len(names), items_per_chunk):
        group = tuple(names[start : start + count])
        start += count
        size = sum(os.path.getsize(os.path.join(directory, name)) for name in group)
        pieces.append(Piece(len(pieces), directory, names=group, size=size))
    return pieces


def plan_digest(pieces: list[Piece]) -> str:
    """A SHA-256 of the pieces: equal plans give equal digests on every machine."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(json.dumps(asdict(piece), sort_keys=True).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()
