"""What the Parquet and Arrow IPC readers share: the chunk reference, the row filter, the
listing of many files, and the rows of one table chunk as a `SkippableIterator`."""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import chain
from typing import Any, NamedTuple, cast

from .._core.extras import missing_extra
from .._core.protocol import SkippableIterator
from ._store import Store
from .listing import find_files

ROWS_PER_BLOCK = 4096
"""Rows converted to dicts at a time (``to_pylist`` of one slice of the table)."""
LISTING_THREADS = 16
"""Footers read at once while listing the chunks of many files."""
_OPERATORS = ("==", "=", "!=", "<", "<=", ">", ">=", "in", "not in")

Patterns = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
Filter = Any
"""A ``pyarrow.compute.Expression``, or a list of ``(column, op, value)`` tuples (all must
hold); `op` is one of ``==`` (or ``=``), ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``,
``not in``, as in pyarrow's own ``filters``."""


class TableChunk(NamedTuple):
    """One chunk of a columnar file: a Parquet row group or an Arrow IPC record batch.

    Plain data (a tuple of str and ints), so that chunk lists fingerprint, pickle and go to
    worker processes; ``(chunk, chunk.rows)`` pairs are what `balanced_shards` takes.
    """

    path: str
    """The file: a local path or a URL, as listed."""
    group: int
    """The number of the row group (Parquet) or record batch (Arrow IPC), from 0."""
    rows: int
    """Its number of rows, from the file's metadata."""


def pyarrow_modules(feature: str) -> Any:
    """The ``pyarrow`` module (with ``pyarrow.compute``, ``.parquet`` and ``.ipc``
    imported), or MissingExtraError naming the ``arrow`` extra."""
    try:
        for name in ("pyarrow.compute", "pyarrow.ipc", "pyarrow.parquet"):
            importlib.import_module(name)
    except ImportError as error:
        raise missing_extra("pyarrow", "arrow", feature) from error
    return importlib.import_module("pyarrow")


def list_table_chunks(
    owner: str,
    patterns: Patterns,
    chunks_of: Callable[[str], list[TableChunk]],
    store: Store,
) -> list[TableChunk]:
    """The chunks (``chunks_of(file)``) of every file matching `patterns`, files in sorted
    order; the files' metadata is read by up to `LISTING_THREADS` threads."""
    many = not isinstance(patterns, (str, os.PathLike))
    each: Sequence[Any] = patterns if many else [patterns]  # type: ignore[assignment]
    if not each:
        raise ValueError(f"{owner}: patterns is empty: give a glob, a file or a list of them")
    files = sorted({ref for pattern in each for ref in find_files(os.fspath(pattern), store)})
    threads = min(LISTING_THREADS, len(files))
    with ThreadPoolExecutor(threads, thread_name_prefix=f"infinibatch_like.{owner}") as pool:
        return [chunk for chunks in pool.map(chunks_of, files) for chunk in chunks]


def filter_expression(owner: str, filter: Filter) -> tuple[Any, list[str] | None]:
    """`filter` as a ``pyarrow.compute.Expression`` (None for no filter) and the columns it
    reads (None where it is an Expression given as such: columns unknown).

    Raises:
        TypeError, ValueError: naming `owner` and the bad term.
    """
    pa = pyarrow_modules(owner)
    pc = pa.compute
    if filter is None:
        return None, []
    if isinstance(filter, pc.Expression):
        return filter, None
    if isinstance(filter, tuple):
        filter = [filter]
    if not isinstance(filter, list) or not filter:
        raise TypeError(
            f"{owner}: filter must be a pyarrow.compute.Expression or a non-empty list of "
            f"(column, op, value) tuples, got {filter!r}"
        )
    expression, columns = None, []
    for term in filter:
        if not (isinstance(term, tuple) and len(term) == 3 and isinstance(term[0], str)):
            raise TypeError(f"{owner}: a filter term must be (column, op, value), got {term!r}")
        column, op, value = term
        if op not in _OPERATORS:
            raise ValueError(
                f"{owner}: the filter term {term!r} has the operator {op!r}; use one of "
                f"{', '.join(_OPERATORS)}"
            )
        field = pc.field(column)
        if op in ("in", "not in"):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(f"{owner}: {op!r} needs a list of values, got {term!r}")
            condition = field.isin(list(value))
            condition = ~condition if op == "not in" else condition
        else:
            condition = {
                "==": field == value,
                "=": field == value,
                "!=": field != value,
                "<": field < value,
                "<=": field <= value,
                ">": field > value,
                ">=": field >= value,
            }[op]
        expression = condition if expression is None else expression & condition
        columns.append(column)
    return expression, columns


class TableRows(SkippableIterator[Any]):
    """The rows (dicts) or record batches of `batch_rows` rows of one table chunk, loaded
    by `load` on the first ``next()`` or ``skip()``; ``skip(n)`` slices the table past the
    skipped rows, so that none of them is converted to a dict."""

    def __init__(self, load: Callable[[], Any], batch_rows: int | None) -> None:
        self._load, self._size = load, 1 if batch_rows is None else batch_rows
        self._batches = batch_rows is not None
        self._table: Any = None
        self._position = 0  # items (rows or batches) passed
        self._items: Iterator[Any] = iter(())

    def _go_to(self, position: int) -> None:
        if self._table is None:
            self._table = self._load()
        self._position = position
        table, size, start = self._table, self._size, position * self._size
        if self._batches:
            self._items = (
                _one_batch(table.slice(row, size)) for row in range(start, table.num_rows, size)
            )
        else:
            blocks = (
                table.slice(row, ROWS_PER_BLOCK).to_pylist()
                for row in range(start, table.num_rows, ROWS_PER_BLOCK)
            )
            self._items = chain.from_iterable(blocks)

    def __next__(self) -> Any:
        if self._table is None:
            self._go_to(0)
        item = next(self._items)
        self._position += 1
        return item

    def skip(self, count: int) -> int:
        if self._table is None:
            self._go_to(0)
        total: int = -(-self._table.num_rows // self._size)
        skipped = max(0, min(count, total - self._position))
        self._go_to(self._position + skipped)
        return skipped


_MISSING_FIELD = re.compile(r"No match for FieldRef\.Name\((.+?)\) in ")


def columns_to_read(
    pa: Any, schema: Any, wanted: list[str] | None, expression: Any, filtered: list[str] | None
) -> list[str] | None:
    """The columns to read for `wanted` (None: all) and a filter: those of `filtered` (a
    filter's columns), or for an Expression filter the columns it refers to, found by
    binding it to empty tables of the schema (every column where that cannot tell)."""
    if wanted is None:
        return None
    if filtered is not None:
        return list(dict.fromkeys([*wanted, *filtered]))
    read = list(wanted)
    names = set(schema.names)
    for _ in range(len(schema.names) + 1):
        try:
            schema.empty_table().select(read).filter(expression)
            return read
        except pa.ArrowInvalid as error:
            found = _MISSING_FIELD.search(str(error))
            if found is None or found.group(1) not in names or found.group(1) in read:
                return None
            read.append(found.group(1))
    return None


def checked_chunk(owner: str, chunk: object) -> tuple[str, int, int]:
    """(path, index, rows) of a `TableChunk` (or such a triple); TypeError otherwise."""
    if (
        isinstance(chunk, tuple)
        and len(chunk) == 3
        and isinstance(chunk[0], (str, os.PathLike))
        and all(type(value) is int and value >= 0 for value in chunk[1:])
    ):
        return os.fspath(chunk[0]), chunk[1], chunk[2]
    raise TypeError(
        f"{owner}: chunk must be a TableChunk (path, group, rows) from a listing, got {chunk!r}"
    )


def checked_columns(owner: str, columns: object) -> list[str] | None:
    if columns is None:
        return None
    names = [] if isinstance(columns, str) else list(cast(Iterable[Any], columns))
    if not names or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"{owner}: columns must be a non-empty list of column names, got {columns!r}"
        )
    return names


def _one_batch(table: Any) -> Any:
    """A (non-empty) table slice as one record batch: without a copy where its columns are
    in one piece each, as a row group's usually are."""
    batches = table.to_batches()
    return batches[0] if len(batches) == 1 else table.combine_chunks().to_batches()[0]
