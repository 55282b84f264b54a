"""Doing one piece of a chunking job: read its items, write its chunks and its manifest.

A piece is read twice: once to count its items, then to cut them into chunks of nearly
equal sizes (`chunk_sizes`); counting first costs a read, not memory.

`write_piece` runs in a worker process or a Dask task; it takes and returns plain,
picklable values. A chunk file that already exists (written by an interrupted run of the
same job: writes are atomic, so an existing file is whole) is not written again; its
items are still read, for its checksum. When every chunk is written, the piece's
manifest (``_pieces/piece-PPPPPP.json``) records them, and a re-run skips the piece.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

from ..io import Record, write_records, write_webdataset
from ..io._lines import BadLine, LineSplitter, line_blocks
from ..io._store import Store
from ..io.output import output_in
from ..io.streams import open_stream
from ..io.webdataset import split_name
from ._refs import join_ref
from .checks import BadLines, json_blocks, text_blocks
from .index import ChunkEntry, entry_from_json
from .plan import Job, Piece, chunk_sizes

PIECES_DIR = "_pieces"
_BLOCK = 1 << 22


def manifest_name(piece: int) -> str:
    """The manifest's path relative to the output directory."""
    return f"{PIECES_DIR}/piece-{piece:06d}.json"


@dataclass(frozen=True)
class PieceDone:
    """What a piece wrote: its chunks' index entries, and the bad lines it skipped (their
    number and the first few described)."""

    entries: list[ChunkEntry]
    skipped: int = 0
    examples: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, raw: object) -> PieceDone:
        """The `PieceDone` of a manifest; ValueError naming what is wrong."""
        if not isinstance(raw, dict) or not isinstance(raw.get("chunks"), list):
            raise ValueError("it is not an object with a list of 'chunks'")
        skipped, examples = raw.get("skipped"), raw.get("examples")
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"its 'skipped' is {skipped!r}, not an int >= 0")
        if not isinstance(examples, list) or not all(isinstance(e, str) for e in examples):
            raise ValueError("its 'examples' is not a list of strings")
        return cls([entry_from_json(entry) for entry in raw["chunks"]], skipped, tuple(examples))

    def to_json(self) -> dict[str, Any]:
        """The piece's manifest."""
        return {
            "chunks": [entry.to_json() for entry in self.entries],
            "skipped": self.skipped,
            "examples": list(self.examples),
        }


def write_piece(
    job: Job,
    piece: Piece,
    out: str,
    existing: Set[str],
    store: Store,
) -> PieceDone:
    """Write the chunks of `piece` under `out` (those named in `existing` are already
    there) and its manifest; return what it wrote.

    Raises:
        ValueError: for a line that is not UTF-8 text (or, in JSON lines, not JSON), naming
            the input and the line number, unless the job's policy skips it (see `checks`).
    """
    entries = []
    bad = BadLines(job.skip_policy(), _where(piece))
    for number, payload, items in _chunk_payloads(job, piece, bad, store):
        name = job.chunk_name(piece.number, number)
        ref = join_ref(out, name)
        if name not in existing:
            with output_in(ref, store) as output:
                output.write(payload)
        size = store.size(ref)
        entries.append(ChunkEntry(name, items, size, hashlib.sha256(payload).hexdigest()))
    done = PieceDone(entries, bad.count, tuple(bad.examples))
    manifest_ref = join_ref(out, manifest_name(piece.number))
    with output_in(manifest_ref, store) as output:
        output.write(json.dumps(done.to_json()).encode("utf-8"))
    return done


def _chunk_payloads(
    job: Job, piece: Piece, bad: BadLines, store: Store
) -> Iterator[tuple[int, bytes, int]]:
    """(chunk number, decompressed content, item count) for each chunk of `piece`: a
    first read counts its items, a second cuts them into chunks of `chunk_sizes`."""
    if job.kind in ("files", "wds"):
        records = [_record(piece.source, name) for name in piece.names]
        buffer = io.BytesIO()
        if job.kind == "files":
            count = write_records(buffer, records)
        else:
            count = write_webdataset(buffer, _samples(records))
        yield 0, buffer.getvalue(), count
        return
    with _line_blocks(piece, store) as blocks:
        counting = BadLines(bad.policy, bad.where)
        items = sum(len(block) for block in _checked(job, blocks, counting))
    sizes = chunk_sizes(items, job.items_per_chunk)
    with _line_blocks(piece, store) as blocks:
        for number, lines in enumerate(_cut(_checked(job, blocks, bad), sizes, piece)):
            yield number, b"\n".join(lines) + b"\n", len(lines)


def _checked(job: Job, blocks: Iterable[list[bytes]], bad: BadLines) -> Iterator[list[bytes]]:
    """The items of a piece, a block at a time: its UTF-8 lines, or for JSON lines its lines
    that hold a JSON value; bad lines raised or skipped by `bad`."""
    return json_blocks(blocks, bad) if job.kind == "jsonl" else text_blocks(blocks, bad)


def _cut(blocks: Iterable[list[bytes]], sizes: list[int], piece: Piece) -> Iterator[list[bytes]]:
    """Runs of `sizes` lines from blocks of lines; ValueError if the blocks hold more or
    fewer lines than `sizes` add up to (the input changed since its items were counted)."""
    runs = iter(sizes)
    size = next(runs, None)
    pending: list[bytes] = []
    for block in blocks:
        pending.extend(block)
        start = 0
        while size is not None and len(pending) - start >= size:
            yield pending[start : start + size]
            start += size
            size = next(runs, None)
        del pending[:start]
        if size is None and pending:
            break
    if size is not None or pending:
        raise ValueError(
            f"chunk: {_where(piece)} changed while it was read: {sum(sizes)} items counted, "
            f"then {'more' if pending else 'fewer'}; run the job again once it is stable"
        )


def _samples(records: list[Record]) -> Iterator[dict[str, Any]]:
    """The samples of a WebDataset piece's files (given sample by sample)."""
    sample: dict[str, Any] = {}
    for name, data in records:
        key, extension = split_name(name)
        if sample.get("__key__") != key:
            if sample:
                yield sample
            sample = {"__key__": key}
        sample[str(extension)] = data
    if sample:
        yield sample


def _record(directory: str, name: str) -> Record:
    with open(f"{directory}/{name}", "rb") as file:
        return Record(name, file.read())


def _where(piece: Piece) -> str:
    return piece.source if piece.end is None else f"{piece.source} (from byte {piece.start})"


@contextmanager
def _line_blocks(piece: Piece, store: Store) -> Iterator[Iterator[list[bytes]]]:
    """The input lines of `piece` (bytes, without their "\\n" or "\\r\\n"), a block at a
    time, split as `read_lines` splits them."""
    if piece.end is None:
        with open_stream(piece.source, store) as stream:
            yield _split(piece.source, stream)
        return
    with open(piece.source, "rb") as file:
        start, end = _line_start(file, piece.start), _line_start(file, piece.end)
        file.seek(start)
        data = file.read(max(0, end - start))
    yield _split(_where(piece), io.BytesIO(data))


def _split(where: str, stream: IO[bytes]) -> Iterator[list[bytes]]:
    for block in line_blocks(stream, LineSplitter.raw(where), _BLOCK):
        if isinstance(block, BadLine):  # a line over a limit: the raw splitter has none
            next(block)  # raises its ChunkFormatError
        else:
            yield block


def _line_start(file: IO[bytes], offset: int) -> int:
    """The offset of the first line that begins at or after `offset`."""
    if offset == 0:
        return 0
    file.seek(offset - 1)
    file.readline()  # the rest of the line holding byte offset - 1 (just b"\n" at a start)
    return file.tell()
