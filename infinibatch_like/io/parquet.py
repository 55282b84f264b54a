"""Parquet files as chunks: one chunk per row group, read with column projection and
filters, resumed at a row without reading any other row group."""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from .._core.checks import require_int
from ._storage import file_version, open_random_access
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


def list_parquet_chunks(
    patterns: Patterns,
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> list[TableChunk]:
    """The row groups of the Parquet files matching `patterns`, as chunk references.

    Each file's footer is read (a request or two for a URL; many files at once, in
    threads); no data is. The files come in `list_chunks` order (sorted), each file's row
    groups in order. ``[(chunk, chunk.rows) for chunk in chunks]`` gives
    `balanced_shards` its ``(chunk, count)`` pairs, and ``sum(c.rows for c in chunks)``
    is the rows per epoch.

    Args:
        patterns: a glob, file or URL (as for `list_chunks`, e.g.
            ``"s3://bucket/data/train-*.parquet"``), or a list of them.
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Returns:
        A `TableChunk` ``(path, group, rows)`` per row group (row groups of no rows are
        left out).

    Raises:
        ChunkFormatError: for a file that is not Parquet, naming it.
        ChunkNotFoundError: if a pattern matches no file.
        ChunkError: as `list_chunks` and `open_chunk`.
        MissingExtraError: without pyarrow (the ``arrow`` extra).
    """
    pa = pyarrow_modules("list_parquet_chunks")
    store = Store.of(storage_options, retry)

    def chunks_of(ref: str) -> list[TableChunk]:
        with open_random_access(ref, store) as file:
            metadata = _footer(pa, file, ref)
        groups = (metadata.row_group(index).num_rows for index in range(metadata.num_row_groups))
        return [TableChunk(ref, index, rows) for index, rows in enumerate(groups) if rows]

    return list_table_chunks("list_parquet_chunks", patterns, chunks_of, store)


def read_parquet(
    chunk: TableChunk,
    *,
    columns: Sequence[str] | None = None,
    filter: Filter = None,
    batch_rows: int | None = None,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Iterator[Any]:
    """The rows of one Parquet row group (a `list_parquet_chunks` chunk), as dicts, or as
    ``pyarrow.RecordBatch`` es; usable as ``read_chunk_fn`` (bind the options with
    `functools.partial`).

    Only the byte ranges of the projected columns (and of the filter's columns) of this row
    group are fetched, at most a request per column chunk on an object store, through the
    same storage layer and retries as every reader; the file's footer is read once per
    process (the latest `FOOTERS_KEPT` files' footers are kept, and used while the file's
    size and modification time or ETag stay the same), plus a request for its size and
    version per row group. The row group is
    read when the first row is taken, whole (decoded into Arrow memory once), then handed
    out a slice at a time.

    Checkpoint:
        The reader holds no state: `SelectManyIterator` (and `chunked_dataset_iterator`)
        records the chunk and the rows (or batches) taken from it. A restore inside a row
        group reads that row group only, never an earlier one, and slices it at the row
        (the returned iterator is a `SkippableIterator`): the rows before it are neither
        converted nor fetched again from earlier row groups.

    Args:
        chunk: a `TableChunk` of `list_parquet_chunks`.
        columns: the columns to read (in this order in each row), or None for all.
        filter: only the rows where it holds: a ``pyarrow.compute.Expression`` (e.g.
            ``pc.field("lang") == "en"``) or a list of ``(column, op, value)`` tuples, all
            of which must hold (op: ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``,
            ``not in``). Its columns are read even where `columns` leaves them out (those
            of an Expression are found by binding it to the file's schema). Positions (and
            checkpoints) count the rows that pass.
        batch_rows: None: yield one dict per row; n: yield record batches of n rows
            (the last of a row group may be shorter), which positions then count.
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        TypeError, ValueError: for a bad argument, at once.
        ChunkFormatError: naming the file and row group, for a file that is not Parquet, a
            row group that is not there (or has another number of rows than listed: the
            file changed), or a column that is not in it.
        ChunkError: as `open_chunk`, naming the file.
        MissingExtraError: without pyarrow (the ``arrow`` extra).
    """
    owner = "read_parquet"
    pa = pyarrow_modules(owner)
    store = Store.of(storage_options, retry)
    path, index, rows = checked_chunk(owner, chunk)
    wanted = checked_columns(owner, columns)
    expression, filtered = filter_expression(owner, filter)
    if batch_rows is not None:
        require_int(owner, "batch_rows", batch_rows, 1)
    where = f"{path} (row group {index})"

    def load() -> Any:
        with open_random_access(path, store) as file:
            metadata = _footer(pa, file, path)
            if index >= metadata.num_row_groups:
                raise ChunkFormatError(
                    f"{where}: the file has {metadata.num_row_groups} row groups: it changed "
                    "since it was listed; list the chunks again"
                )
            schema = metadata.schema.to_arrow_schema()
            unknown = sorted({*(wanted or ()), *(filtered or ())} - set(schema.names))
            if unknown:
                raise ChunkFormatError(f"{where}: no column {unknown} (it has {schema.names})")
            read = columns_to_read(pa, schema, wanted, expression, filtered)
            try:
                parquet = pa.parquet.ParquetFile(file, metadata=metadata)
                table = parquet.read_row_group(index, columns=read, use_threads=False)
            except ChunkError:
                raise
            except (pa.ArrowException, OSError) as error:
                raise ChunkFormatError(f"{where}: cannot be read: {error}") from error
        if table.num_rows != rows:
            raise ChunkFormatError(
                f"{where}: holds {table.num_rows} rows, {rows} when it was listed: the file "
                "changed; list the chunks again"
            )
        if expression is not None:
            table = table.filter(expression)
        return table if wanted is None else table.select(wanted)

    return TableRows(load, batch_rows)


_MAGIC = b"PAR1"
_TAIL = struct.Struct("<i4s")  # the footer's length, the magic
_FOOTER_LIMIT = 1 << 28


FOOTERS_KEPT = 16
"""Parquet footers kept per process (the latest used), so that reading the row groups of a
file one by one reads its footer once (a footer can be megabytes)."""
_footers: OrderedDict[tuple[str, str], Any] = OrderedDict()
_footers_lock = threading.Lock()


def _footer(pa: Any, file: BinaryIO, ref: str) -> Any:
    """The ``FileMetaData`` of a Parquet file: from the `FOOTERS_KEPT` latest where the
    file is unchanged (same size and modification time or ETag), else read."""
    version = file_version(file)
    if version is None:
        return _read_footer(pa, file, ref)
    key = (ref, version)
    with _footers_lock:
        if key in _footers:
            _footers.move_to_end(key)
            return _footers[key]
    metadata = _read_footer(pa, file, ref)
    with _footers_lock:
        _footers[key] = metadata
        while len(_footers) > FOOTERS_KEPT:
            _footers.popitem(last=False)
    return metadata


def _read_footer(pa: Any, file: BinaryIO, ref: str) -> Any:
    """The ``FileMetaData`` of a Parquet file, in two reads of exactly its footer (pyarrow
    alone reads the last 64 KB)."""
    size = file.seek(0, 2)
    if size >= 2 * len(_MAGIC) + 4:
        file.seek(size - _TAIL.size)
        tail = file.read(_TAIL.size)
        length, magic = _TAIL.unpack(tail)
        if magic == _MAGIC and 0 < length <= min(size - _TAIL.size - len(_MAGIC), _FOOTER_LIMIT):
            file.seek(size - _TAIL.size - length)
            footer = file.read(length)
            try:
                return pa.parquet.read_metadata(pa.BufferReader(_MAGIC + footer + tail))
            except (pa.ArrowException, OSError) as error:
                raise ChunkFormatError(f"{ref}: damaged Parquet footer ({error})") from error
    raise ChunkFormatError(
        f"{ref}: not a Parquet file ({size} bytes, not ending in a footer and {_MAGIC!r})"
    )
