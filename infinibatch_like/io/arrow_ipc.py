"""Arrow IPC files (Feather v2) as chunks: one chunk per record batch, read with column
projection and filters, resumed at a row without reading any other batch.

Listing reads the file's footer and each batch's message header (a few hundred bytes),
never a batch's body: the row count of a batch is in its header, which this module
reads itself (the footer's blocks and the header are small flatbuffers).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from .._core.checks import require_int
from ._storage import open_random_access
from ._store import StorageOptions, Store
from ._tables import (
    Filter,
    Patterns,
    TableChunk,
    TableRows,
    checked_chunk,
    checked_columns,
    columns_to_read,
    filter_expression,
    list_table_chunks,
    pyarrow_modules,
)
from .errors import ChunkError, ChunkFormatError
from .retry import RetryPolicy

_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
_BLOCK = struct.Struct("<qi4xq")  # offset, metadata length, (padding), body length
_HEADER_LIMIT = 1 << 26
"""The largest footer or message header read (a damaged length is not allocated)."""
_RECORD_BATCH = 3  # MessageHeader union: Schema 1, DictionaryBatch 2, RecordBatch 3


def list_arrow_chunks(
    patterns: Patterns,
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> list[TableChunk]:
    """The record batches of the Arrow IPC files (Feather v2, ``.arrow``/``.feather``)
    matching `patterns`, as chunk references: as `list_parquet_chunks`, with a record
    batch in place of a row group. Each file's footer and batch headers are read, no
    batch body.

    Raises:
        ChunkFormatError: for a file that is not an Arrow IPC file (an IPC *stream*, with
            no footer, cannot be read at a batch), naming it.
        ChunkNotFoundError, ChunkError: as `list_chunks` and `open_chunk`.
    """
    store = Store.of(storage_options, retry)

    def chunks_of(ref: str) -> list[TableChunk]:
        with open_random_access(ref, store) as file:
            counts = _batch_rows(file, ref)
        return [TableChunk(ref, index, rows) for index, rows in enumerate(counts) if rows]

    return list_table_chunks("list_arrow_chunks", patterns, chunks_of, store)


def read_arrow(
    chunk: TableChunk,
    *,
    columns: Sequence[str] | None = None,
    filter: Filter = None,
    batch_rows: int | None = None,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Iterator[Any]:
    """The rows of one record batch of an Arrow IPC file (a `list_arrow_chunks` chunk), as
    dicts or as record batches: as `read_parquet`. Only the projected columns' buffers
    (and those of the filter) are fetched, plus the footer.

    Checkpoint:
        The reader holds no state; a restore inside a batch reads that batch only and
        slices it at the row (the returned iterator is a `SkippableIterator`).

    Raises:
        TypeError, ValueError: for a bad argument, at once.
        ChunkFormatError: naming the file and batch, for a file that is not an Arrow IPC
            file, a batch that is not there (or has another number of rows than listed),
            or a column that is not in it.
        ChunkError: as `open_chunk`.
        MissingExtraError: without pyarrow (the ``arrow`` extra).
    """
    owner = "read_arrow"
    pa = pyarrow_modules(owner)
    store = Store.of(storage_options, retry)
    path, index, rows = checked_chunk(owner, chunk)
    wanted = checked_columns(owner, columns)
    expression, filtered = filter_expression(owner, filter)
    if batch_rows is not None:
        require_int(owner, "batch_rows", batch_rows, 1)
    where = f"{path} (record batch {index})"

    def load() -> Any:
        with open_random_access(path, store) as file:
            try:
                schema = pa.ipc.open_file(file).schema
                names = schema.names
                unknown = sorted({*(wanted or ()), *(filtered or ())} - set(names))
                if unknown:
                    raise ChunkFormatError(f"{where}: no column {unknown} (it has {names})")
                read = columns_to_read(pa, schema, wanted, expression, filtered)
                options = pa.ipc.IpcReadOptions(
                    included_fields=None
                    if read is None
                    else [i for i, name in enumerate(names) if name in read],
                    use_threads=False,
                )
                batch = pa.ipc.open_file(file, options=options).get_batch(index)
            except ChunkError:
                raise
            except (pa.ArrowException, OSError, IndexError) as error:
                raise ChunkFormatError(f"{where}: cannot be read: {error}") from error
        if batch.num_rows != rows:
            raise ChunkFormatError(
                f"{where}: holds {batch.num_rows} rows, {rows} when it was listed: the file "
                "changed; list the chunks again"
            )
        table = pa.Table.from_batches([batch])
        if expression is not None:
            table = table.filter(expression)
        return table if wanted is None else table.select(wanted)

    return TableRows(load, batch_rows)


def _batch_rows(file: BinaryIO, ref: str) -> list[int]:
    """The row count of each record batch of an Arrow IPC file, from its footer's blocks
    and each batch's message header."""
    size = file.seek(0, 2)
    tail_size = len(_MAGIC) + 4
    if size < 2 * len(_MAGIC) + tail_size:
        raise ChunkFormatError(f"{ref}: not an Arrow IPC file ({size} bytes)")
    file.seek(size - tail_size)
    tail = file.read(tail_size)
    (footer_size,) = struct.unpack("<i", tail[:4])
    if tail[4:] != _MAGIC or not 0 < footer_size <= min(_HEADER_LIMIT, size - tail_size):
        raise ChunkFormatError(
            f"{ref}: not an Arrow IPC file (no footer ending in {_MAGIC!r}; an IPC stream "
            "cannot be read at a batch: write it with pyarrow.ipc.new_file)"
        )
    file.seek(size - tail_size - footer_size)
    footer = _Flat(file.read(footer_size), ref)
    blocks = footer.root().vector(3)  # Footer.recordBatches
    counts = []
    for position in blocks:
        offset, length, _ = _BLOCK.unpack_from(footer.data, position)
        if not 8 <= length <= _HEADER_LIMIT or offset < 0 or offset + length > size:
            raise ChunkFormatError(f"{ref}: damaged Arrow IPC footer (a block at {offset})")
        file.seek(offset)
        header = file.read(length)
        start = 8 if header[:4] == _CONTINUATION else 4  # a marker, then the length
        message = _Flat(header[start:], ref).root()
        if message.scalar(1, "<B") != _RECORD_BATCH:  # Message.header_type
            raise ChunkFormatError(f"{ref}: damaged Arrow IPC file (block at {offset})")
        counts.append(message.table(2).scalar(0, "<q"))  # Message.header: RecordBatch.length
    return counts


class _Flat:
    """Just enough of a flatbuffer reader for the Arrow footer and message headers."""

    def __init__(self, data: bytes, ref: str) -> None:
        self.data, self.ref = data, ref

    def root(self) -> _Table:
        return _Table(self, self._u32(0))

    def _u32(self, position: int) -> int:
        if not 0 <= position <= len(self.data) - 4:
            raise ChunkFormatError(f"{self.ref}: damaged Arrow IPC metadata (offset {position})")
        value: int = struct.unpack_from("<I", self.data, position)[0]
        return value


class _Table:
    def __init__(self, flat: _Flat, position: int) -> None:
        self.flat, self.position = flat, position
        (relative,) = struct.unpack_from("<i", flat.data, position)
        self.vtable = position - relative
        if not 0 <= self.vtable <= len(flat.data) - 4:
            raise ChunkFormatError(f"{flat.ref}: damaged Arrow IPC metadata (a vtable)")

    def _field(self, number: int) -> int:
        """The field's position, or 0 where it is absent."""
        data, vtable = self.flat.data, self.vtable
        (vtable_size,) = struct.unpack_from("<H", data, vtable)
        entry = vtable + 4 + 2 * number
        if entry + 2 > vtable + vtable_size or entry + 2 > len(data):
            return 0
        (offset,) = struct.unpack_from("<H", data, entry)
        return self.position + offset if offset else 0

    def scalar(self, number: int, kind: str) -> int:
        position = self._field(number)
        if not position or position + struct.calcsize(kind) > len(self.flat.data):
            return 0
        value: int = struct.unpack_from(kind, self.flat.data, position)[0]
        return value

    def table(self, number: int) -> _Table:
        position = self._field(number)
        if not position:
            raise ChunkFormatError(f"{self.flat.ref}: damaged Arrow IPC metadata (no table)")
        return _Table(self.flat, position + self.flat._u32(position))

    def vector(self, number: int) -> list[int]:
        """The positions of a vector's elements (structs of `_BLOCK` size)."""
        position = self._field(number)
        if not position:
            return []
        start = position + self.flat._u32(position)
        count = self.flat._u32(start)
        if start + 4 + count * _BLOCK.size > len(self.flat.data):
            raise ChunkFormatError(f"{self.flat.ref}: damaged Arrow IPC footer (its blocks)")
        return [start + 4 + index * _BLOCK.size for index in range(count)]
