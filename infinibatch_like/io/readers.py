"""`read_lines` and `read_jsonl`: a chunk's text lines or JSON records, streamed.

Both read the chunk in blocks of `BLOCK_SIZE` decompressed bytes and hand out one block's
lines at a time (``itertools.chain``), so there is no Python work per line beyond splitting
(and, for JSON lines, parsing).
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

from .._callables import short_repr
from ._compression import codec_for, refuse_archive
from ._storage import StorageOptions
from .errors import ChunkFormatError
from .retry import RetryPolicy
from .streams import Ref, open_chunk

BLOCK_SIZE = 1 << 22
"""Decompressed bytes read (and split into lines) at a time."""


def read_lines(
    ref: Ref,
    *,
    storage_options: StorageOptions | None = None,
    encoding: str = "utf-8",
    errors: str = "strict",
    retry: RetryPolicy | None = None,
) -> Iterator[str]:
    """The lines of a chunk file, without their line endings; usable as ``read_chunk_fn``.

    Lines end with ``"\\n"`` or ``"\\r\\n"`` (both removed); a lone ``"\\r"`` is kept, as are
    other characters that `str.splitlines` would split at (form feeds, ``"\\x1c"``,
    ``"\\u2028"``, ...). A last line without a line ending is a line; an empty file has no
    lines. The chunk is opened when the first line is taken; an unsupported suffix, an
    unknown encoding or a missing extra is refused at once.

    To give `storage_options` (or another argument) when it is used as ``read_chunk_fn``,
    bind it with `functools.partial`, which pickles for worker processes::

        read_chunk_fn = functools.partial(read_lines, storage_options={"anon": True})

    Args:
        ref: a local path or URL; compression from its suffix (see `open_chunk`).
        storage_options: options of the fsspec file system of a URL.
        encoding: the text encoding of the decompressed bytes (as in `bytes.decode`).
        errors: what to do with bytes that do not decode (as in `bytes.decode`).
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkFormatError: for text that is not valid in `encoding`, naming the chunk and the
            byte offset, or for corrupt compressed data.
        ChunkError, ValueError, MissingExtraError: as `open_chunk`.
    """
    name = os.fspath(ref)
    codec_for(name)  # a bad suffix or a missing extra is reported now, not on the first line
    refuse_archive(name, "read_lines")
    codecs.lookup(encoding)
    return chain.from_iterable(_line_blocks(name, storage_options, encoding, errors, retry))


def read_jsonl(
    ref: Ref,
    *,
    storage_options: StorageOptions | None = None,
    loads: Callable[[str], Any] = json.loads,
    retry: RetryPolicy | None = None,
) -> Iterator[Any]:
    """The JSON values of a JSON-lines chunk, one per line; usable as ``read_chunk_fn``.

    Lines are read as by `read_lines` (UTF-8); blank lines (empty or white space only) are
    skipped, as many JSON-lines writers end with one.

    Args:
        ref: a local path or URL; compression from its suffix (see `open_chunk`).
        storage_options: options of the fsspec file system of a URL.
        loads: the parser of one line (e.g. ``orjson.loads``); it must raise ValueError
            for a bad line.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkFormatError: for a line that is not JSON, naming the chunk and the line number
            (from 1), when the consumer reaches that line's block.
        ChunkError, ValueError, MissingExtraError: as `open_chunk`.
    """
    name = os.fspath(ref)
    codec_for(name)
    refuse_archive(name, "read_jsonl")
    blocks = _line_blocks(name, storage_options, "utf-8", "strict", retry)
    return chain.from_iterable(_parsed_blocks(name, blocks, loads))


def _line_blocks(
    ref: str,
    storage_options: StorageOptions | None,
    encoding: str,
    errors: str,
    retry: RetryPolicy | None,
) -> Iterator[list[str]]:
    """The lines of `ref`, a block at a time."""
    with open_chunk(ref, storage_options=storage_options, retry=retry) as stream:
        decoder = codecs.getincrementaldecoder(encoding)(errors)
        tail, offset = "", 0
        while True:
            data = stream.read(BLOCK_SIZE)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as error:
                raise ChunkFormatError(
                    f"{ref}: not valid {encoding} text at byte {offset + error.start} of its "
                    f"decompressed data ({error.reason})"
                ) from error
            offset += len(data)
            if tail:
                text = tail + text
            if "\r" in text:
                text = text.replace("\r\n", "\n")  # a "\r" at the end waits in `tail`
            lines = text.split("\n")
            tail = lines.pop()
            if lines:
                yield lines
            if not data:
                break
        if tail:
            yield [tail]


def _parsed_blocks(
    ref: str, blocks: Iterator[list[str]], loads: Callable[[str], Any]
) -> Iterator[list[Any]]:
    first_line = 1
    for block in blocks:
        try:
            values = [loads(line) for line in block if line and not line.isspace()]
        except ValueError:
            yield from _parsed_until_error(ref, block, first_line, loads)
            raise AssertionError("unreachable: a line of the block was refused") from None
        first_line += len(block)
        yield values


def _parsed_until_error(
    ref: str, block: list[str], first_line: int, loads: Callable[[str], Any]
) -> Iterator[list[Any]]:
    """The values of `block` before its first bad line, then the error naming that line."""
    values = []
    for number, line in enumerate(block, first_line):
        if line and not line.isspace():
            try:
                values.append(loads(line))
            except ValueError as error:
                yield values
                raise ChunkFormatError(
                    f"{ref}, line {number}: not valid JSON ({error}): {short_repr(line)}"
                ) from error
