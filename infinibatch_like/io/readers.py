"""`read_lines` and `read_jsonl`: a chunk's text lines or JSON records, streamed.

Both read the chunk in blocks of `BLOCK_SIZE` decompressed bytes and hand out one block's
lines at a time (``itertools.chain``), so there is no Python work per line beyond splitting
(and, for JSON lines, parsing). A bad line raises `ChunkFormatError` where it is, after
every line before it; calling ``next()`` again goes on with the line after it, which is how
a stage with ``on_error=SkipPolicy(...)`` skips just that record.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

from .._core.checks import require_int
from .._core.names import short_repr
from ._compression import codec_for, refuse_archive
from ._lines import BadLine, Block, LineSplitter, bad_line, line_blocks
from ._store import StorageOptions, Store
from .retry import RetryPolicy
from .streams import Ref, open_stream

BLOCK_SIZE = 1 << 22
"""Decompressed bytes read (and split into lines) at a time."""
MAX_LINE_LENGTH = 1 << 26
"""The default longest line, in characters (64 Mi): far longer than a text or a JSON record
to train on, short enough that a file without line endings (a binary file read by mistake)
is refused after 64 MB rather than read whole into memory."""


def read_lines(
    ref: Ref,
    *,
    storage_options: StorageOptions | None = None,
    encoding: str = "utf-8",
    errors: str = "strict",
    retry: RetryPolicy | None = None,
    max_line_length: int | None = MAX_LINE_LENGTH,
) -> Iterator[str]:
    """The lines of a chunk file, without their line endings; usable as ``read_chunk_fn``.

    Lines end with ``"\\n"`` or ``"\\r\\n"`` (both removed); a lone ``"\\r"`` is kept, as are
    other characters that `str.splitlines` would split at (form feeds, ``"\\x1c"``,
    ``"\\u2028"``, ...). A last line without a line ending is a line; an empty file has no
    lines. The chunk is opened when the first line is taken; an unsupported suffix, an
    unknown encoding, a bad `max_line_length` or a missing extra is refused at once.

    A bad line (text not valid in `encoding`, a line longer than `max_line_length`) raises
    `ChunkFormatError` in its place; the next ``next()`` goes on with the line after it.
    Time is linear in the chunk's size, however long its lines.

    To give `storage_options` (or another argument) when it is used as ``read_chunk_fn``,
    bind it with `functools.partial`, which pickles for worker processes::

        read_chunk_fn = functools.partial(read_lines, storage_options={"anon": True})

    Args:
        ref: a local path or URL; compression from its suffix (see `open_chunk`).
        storage_options: options of the fsspec file system of a URL.
        encoding: the text encoding of the decompressed bytes (as in `bytes.decode`).
        errors: what to do with bytes that do not decode (as in `bytes.decode`).
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).
        max_line_length: the longest line accepted, in characters without the line ending
            (`MAX_LINE_LENGTH`, 64 Mi, by default; None: no limit). A longer line is
            refused as soon as it passes the limit, so memory stays bounded.

    Raises:
        ChunkFormatError: naming the chunk and the line number (from 1), for text that is
            not valid in `encoding` (with its byte offset in the decompressed data) or a
            line longer than `max_line_length`; naming the chunk, for corrupt compressed
            data.
        TypeError, ValueError: for a `max_line_length` that is not an int >= 1 or None.
        ChunkError, ValueError, MissingExtraError: as `open_chunk`.
    """
    name = _checked("read_lines", ref, max_line_length)
    codecs.lookup(encoding)
    return lines_in(name, Store.of(storage_options, retry), encoding, errors, max_line_length)


def read_jsonl(
    ref: Ref,
    *,
    storage_options: StorageOptions | None = None,
    loads: Callable[[str], Any] = json.loads,
    retry: RetryPolicy | None = None,
    max_line_length: int | None = MAX_LINE_LENGTH,
) -> Iterator[Any]:
    """The JSON values of a JSON-lines chunk, one per line; usable as ``read_chunk_fn``.

    Lines are read as by `read_lines` (UTF-8); blank lines (empty or white space only) are
    skipped, as many JSON-lines writers end with one. A bad line (not UTF-8, too long, not
    JSON, or nested too deeply to parse) raises `ChunkFormatError` in its place, after every
    value before it; the next ``next()`` goes on with the line after it.

    Args:
        ref: a local path or URL; compression from its suffix (see `open_chunk`).
        storage_options: options of the fsspec file system of a URL.
        loads: the parser of one line (e.g. ``orjson.loads``); it must raise ValueError
            (or RecursionError) for a bad line.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).
        max_line_length: as in `read_lines`.

    Raises:
        ChunkFormatError: for a bad line, naming the chunk, the line number (from 1) and
            the cause, with how to skip bad records.
        TypeError, ValueError: for a `max_line_length` that is not an int >= 1 or None.
        ChunkError, ValueError, MissingExtraError: as `open_chunk`.
    """
    name = _checked("read_jsonl", ref, max_line_length)
    return json_values_in(name, Store.of(storage_options, retry), loads, max_line_length)


def lines_in(
    name: str,
    store: Store,
    encoding: str = "utf-8",
    errors: str = "strict",
    max_line_length: int | None = MAX_LINE_LENGTH,
) -> Iterator[str]:
    """`read_lines` of the chunk `name` in `store` (its arguments checked)."""
    return chain.from_iterable(_line_blocks(name, store, encoding, errors, max_line_length))


def json_values_in(
    name: str,
    store: Store,
    loads: Callable[[str], Any] = json.loads,
    max_line_length: int | None = MAX_LINE_LENGTH,
) -> Iterator[Any]:
    """`read_jsonl` of the chunk `name` in `store` (its arguments checked)."""
    blocks = _line_blocks(name, store, "utf-8", "strict", max_line_length)
    return chain.from_iterable(_parsed_blocks(name, blocks, loads))


def _checked(owner: str, ref: Ref, max_line_length: int | None) -> str:
    """The name of `ref`, once its suffix (and extra) and `max_line_length` are checked:
    a bad argument is reported now, not on the first line."""
    name = os.fspath(ref)
    codec_for(name)
    refuse_archive(name, owner)
    if max_line_length is not None:
        require_int(owner, "max_line_length", max_line_length, 1)
    return name


def _line_blocks(
    ref: str, store: Store, encoding: str, errors: str, limit: int | None
) -> Iterator[Block]:
    """The lines of `ref`, a block at a time, with a `BadLine` in place of each bad line."""
    with open_stream(ref, store) as stream:
        yield from line_blocks(stream, LineSplitter.text(ref, encoding, errors, limit), BLOCK_SIZE)


def _parsed_blocks(
    ref: str, blocks: Iterator[Block], loads: Callable[[str], Any]
) -> Iterator[list[Any] | BadLine]:
    """The values of the lines of `blocks`, with a `BadLine` in place of each bad one."""
    first_line = 1
    for block in blocks:
        if isinstance(block, BadLine):
            yield block
            first_line += 1
            continue
        try:
            values = [loads(line) for line in block if line and not line.isspace()]
        except (ValueError, RecursionError):
            yield from _parsed_one_by_one(ref, block, first_line, loads)
        else:
            yield values
        first_line += len(block)


def _parsed_one_by_one(
    ref: str, block: list[str], first_line: int, loads: Callable[[str], Any]
) -> Iterator[list[Any] | BadLine]:
    """The values of `block`, with a `BadLine` in place of each line that is not JSON."""
    values: list[Any] = []
    for number, line in enumerate(block, first_line):
        if not line or line.isspace():
            continue
        try:
            values.append(loads(line))
        except (ValueError, RecursionError) as error:
            if values:
                yield values
                values = []
            nested = isinstance(error, RecursionError)
            what = "JSON nested too deeply to parse" if nested else "not valid JSON"
            yield bad_line(ref, number, f"{what} ({error}): {short_repr(line)}", error)
    if values:
        yield values
