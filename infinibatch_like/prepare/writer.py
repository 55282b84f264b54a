"""Doing one piece of a chunking job: read its items, write its chunks and its manifest.

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
from typing import IO, Any

from ..io import Record, open_chunk, open_output, write_records
from ._refs import join_ref, stored_size
from .index import ChunkEntry
from .plan import Job, Piece

PIECES_DIR = "_pieces"
_BLOCK = 1 << 22


def manifest_name(piece: int) -> str:
    """The manifest's path relative to the output directory."""
    return f"{PIECES_DIR}/piece-{piece:06d}.json"


def write_piece(
    job: Job,
    piece: Piece,
    out: str,
    existing: Set[str],
    storage_options: dict[str, Any] | None,
) -> list[ChunkEntry]:
    """Write the chunks of `piece` under `out` (those named in `existing` are already
    there) and its manifest; return the chunks' index entries.

    Raises:
        ValueError: for a JSON-lines input with a line that is not JSON, naming the input
            and the line number.
    """
    entries = []
    for number, payload, items in _chunk_payloads(job, piece, storage_options):
        name = job.chunk_name(piece.number, number)
        ref = join_ref(out, name)
        if name not in existing:
            with open_output(ref, storage_options=storage_options) as output:
                output.write(payload)
        size = stored_size(ref, storage_options=storage_options)
        entries.append(ChunkEntry(name, items, size, hashlib.sha256(payload).hexdigest()))
    manifest = json.dumps([entry.to_json() for entry in entries]).encode("utf-8")
    manifest_ref = join_ref(out, manifest_name(piece.number))
    with open_output(manifest_ref, storage_options=storage_options) as output:
        output.write(manifest)
    return entries


def _chunk_payloads(
    job: Job, piece: Piece, storage_options: dict[str, Any] | None
) -> Iterator[tuple[int, bytes, int]]:
    """(chunk number, decompressed content, item count) for each chunk of `piece`."""
    if job.kind == "files":
        records = [_record(piece.source, name) for name in piece.names]
        buffer = io.BytesIO()
        write_records(buffer, records)
        yield 0, buffer.getvalue(), len(records)
        return
    with _line_blocks(piece, storage_options) as blocks:
        if job.kind == "jsonl":
            blocks = _json_blocks(piece, blocks)
        for number, (first_line, lines) in enumerate(_cut(blocks, job.items_per_chunk)):
            payload = b"\n".join(lines) + b"\n"
            if job.kind == "lines":
                _check_text(piece, first_line, payload)
            yield number, payload, len(lines)


def _cut(blocks: Iterable[list[bytes]], size: int) -> Iterator[tuple[int, list[bytes]]]:
    """Runs of `size` lines (the last one shorter) from blocks of lines, with the number
    (from 1) of each run's first line."""
    pending: list[bytes] = []
    first = 1
    for block in blocks:
        pending.extend(block)
        start = 0
        while len(pending) - start >= size:
            yield first, pending[start : start + size]
            start += size
            first += size
        del pending[:start]
    if pending:
        yield first, pending


def _record(directory: str, name: str) -> Record:
    with open(f"{directory}/{name}", "rb") as file:
        return Record(name, file.read())


def _where(piece: Piece) -> str:
    return piece.source if piece.end is None else f"{piece.source} (from byte {piece.start})"


def _check_text(piece: Piece, first_line: int, payload: bytes) -> None:
    """Raise ValueError naming the line if `payload` is not UTF-8 (as ``read_lines`` reads)."""
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + payload.count(b"\n", 0, error.start)
        column = error.start - payload.rfind(b"\n", 0, error.start) - 1
        raise ValueError(
            f"chunk: line {line} of {_where(piece)} is not UTF-8 text ({error.reason} at "
            f"byte {column} of the line)"
        ) from None


def _json_blocks(piece: Piece, blocks: Iterable[list[bytes]]) -> Iterator[list[bytes]]:
    """The lines that hold a JSON value, each checked; blank lines left out (as
    ``read_jsonl`` skips them)."""
    number = 0
    for block in blocks:
        kept = []
        for number, line in enumerate(block, number + 1):  # noqa: B020 - runs on
            try:
                text = line.decode("utf-8")
                if text and not text.isspace():
                    json.loads(text)
                    kept.append(line)
            except ValueError as error:  # UnicodeDecodeError too
                raise ValueError(
                    f"chunk: line {number} of {_where(piece)} is not JSON ({error}): {line[:80]!r}"
                ) from None
            except RecursionError:
                raise ValueError(
                    f"chunk: line {number} of {_where(piece)} is nested too deeply to parse: "
                    f"{line[:80]!r}"
                ) from None
        yield kept


@contextmanager
def _line_blocks(
    piece: Piece, storage_options: dict[str, Any] | None
) -> Iterator[Iterator[list[bytes]]]:
    """The input lines of `piece` (bytes, without their "\\n"), a block at a time."""
    if piece.end is None:
        with open_chunk(piece.source, storage_options=storage_options) as stream:
            yield _split(stream)
        return
    with open(piece.source, "rb") as file:
        start, end = _line_start(file, piece.start), _line_start(file, piece.end)
        file.seek(start)
        data = file.read(max(0, end - start))
    yield _split(io.BytesIO(data))


def _split(stream: IO[bytes]) -> Iterator[list[bytes]]:
    tail = b""
    while block := stream.read(_BLOCK):
        lines = (tail + block).split(b"\n")
        tail = lines.pop()
        yield lines
    if tail:
        yield [tail]


def _line_start(file: IO[bytes], offset: int) -> int:
    """The offset of the first line that begins at or after `offset`."""
    if offset == 0:
        return 0
    file.seek(offset - 1)
    file.readline()  # the rest of the line holding byte offset - 1 (just b"\n" at a start)
    return file.tell()
