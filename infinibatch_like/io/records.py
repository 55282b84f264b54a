"""A binary record file: many small named blobs (e.g. image files) packed in one chunk.

Layout (little-endian): the 8-byte magic `MAGIC`; per record a header ``(name length:
u32, data length: u64)``, the UTF-8 name, the data; and an end marker, a header whose name
length is ``0xFFFFFFFF`` and whose data length is the number of records. The end marker
makes a file cut anywhere, even between two records, detectably truncated.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO, NamedTuple

from .._core.names import short_repr
from ._compression import codec_for, refuse_archive
from ._store import StorageOptions, Store
from .errors import ChunkFormatError
from .retry import RetryPolicy
from .streams import Ref, open_stream

MAGIC = b"\x93IBLREC\x01"
"""The first bytes of a record file (the last one is the format version)."""
NAME_LIMIT = 1 << 16
"""The longest record name, in UTF-8 bytes."""
_HEADER = struct.Struct("<IQ")
_END = 0xFFFFFFFF
_PIECE = 1 << 24  # data is read in pieces of at most this size (a corrupt length is not allocated)


class Record(NamedTuple):
    """One packed blob: its name (e.g. the relative path of the file it came from) and data."""

    name: str
    data: bytes


def write_records(out: BinaryIO, records: Iterable[tuple[str, bytes]]) -> int:
    """Write `records` (`Record`s or ``(name, data)`` pairs) to `out` as a record file.

    `out` is typically ``open_output("chunk-00001.rec.zst")``. Returns how many records
    were written.

    Raises:
        TypeError: for a record that is not a (str, bytes-like) pair, naming its index.
        ValueError: for a name longer than `NAME_LIMIT` UTF-8 bytes.
    """
    out.write(MAGIC)
    count = 0
    for count, record in enumerate(records, 1):  # `count` is the total after
        name, data = _checked(record, count - 1)
        encoded = name.encode("utf-8")
        out.write(_HEADER.pack(len(encoded), len(data)))
        out.write(encoded)
        out.write(data)
    out.write(_HEADER.pack(_END, count))
    return count


def _checked(record: object, index: int) -> tuple[str, bytes | bytearray | memoryview]:
    if not (isinstance(record, tuple) and len(record) == 2):
        raise TypeError(
            f"write_records: record {index} must be a Record or a (name, data) pair, got "
            f"{short_repr(record)}"
        )
    name, data = record
    if not isinstance(name, str) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"write_records: record {index} must be (str, bytes), got "
            f"({type(name).__name__}, {type(data).__name__})"
        )
    if len(name.encode("utf-8")) >= NAME_LIMIT:
        raise ValueError(
            f"write_records: the name of record {index} is longer than {NAME_LIMIT} bytes: "
            f"{short_repr(name)}"
        )
    return name, data


def read_records(
    ref: Ref, *, storage_options: StorageOptions | None = None, retry: RetryPolicy | None = None
) -> Iterator[Record]:
    """The records of a record file written by `write_records`; usable as ``read_chunk_fn``.

    Args:
        ref: a local path or URL; compression from its suffix (see `open_chunk`).
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkFormatError: naming the chunk, for a file that is not a record file, or that is
            truncated or damaged (raised when the reader reaches the damage; the records
            before it are yielded).
        ChunkError, ValueError, MissingExtraError: as `open_chunk`.
    """
    name = os.fspath(ref)
    codec_for(name)  # a bad suffix or a missing extra is reported now, not on the first record
    refuse_archive(name, "read_records")
    return records_in(name, Store.of(storage_options, retry))


def records_in(name: str, store: Store) -> Iterator[Record]:
    """`read_records` of the chunk `name` in `store` (its suffix checked)."""
    with open_stream(name, store) as stream:
        head = stream.read(len(MAGIC))
        if head != MAGIC:
            raise ChunkFormatError(
                f"{name}: not a record file: it starts with {head!r}, not {MAGIC!r} (record "
                "files are written by infinibatch_like.io.write_records)"
            )
        index = 0
        while True:
            header = stream.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise _truncated(name, index, "before the end marker")
            name_length, data_length = _HEADER.unpack(header)
            if name_length == _END:
                _check_end(name, stream, index, data_length)
                return
            if name_length >= NAME_LIMIT:
                raise ChunkFormatError(
                    f"{name}: damaged record file: record {index} has a name of "
                    f"{name_length} bytes (at most {NAME_LIMIT})"
                )
            record_name = _read_exactly(stream, name_length, name, index)
            data = _read_exactly(stream, data_length, name, index)
            try:
                decoded = record_name.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ChunkFormatError(
                    f"{name}: damaged record file: the name of record {index} is not UTF-8"
                ) from error
            yield Record(decoded, data)
            index += 1


def _read_exactly(stream: BinaryIO, size: int, ref: str, index: int) -> bytes:
    pieces, left = [], size
    while left:
        piece = stream.read(min(left, _PIECE))
        if not piece:
            raise _truncated(ref, index, f"inside record {index}")
        pieces.append(piece)
        left -= len(piece)
    return b"".join(pieces)


def _check_end(ref: str, stream: BinaryIO, index: int, count: int) -> None:
    if count != index:
        raise ChunkFormatError(
            f"{ref}: damaged record file: its end marker counts {count} records, but "
            f"{index} were read"
        )
    if stream.read(1):
        raise ChunkFormatError(f"{ref}: damaged record file: data after the end marker")


def _truncated(ref: str, index: int, where: str) -> ChunkFormatError:
    return ChunkFormatError(
        f"{ref}: truncated record file: it ends {where} (after {index} complete records)"
    )
