"""`open_chunk`: the decompressed bytes of a chunk, local or remote."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import IO, Any, BinaryIO, TypeVar, cast

from ._compression import Codec, codec_for
from ._storage import open_raw
from ._store import StorageOptions, Store, is_url
from .errors import ChunkError, ChunkFormatError
from .retry import RetryPolicy

T = TypeVar("T")
Ref = str | os.PathLike[str]
"""A chunk reference: a local path (str or ``pathlib.Path``) or a URL."""


def open_chunk(
    ref: Ref, *, storage_options: StorageOptions | None = None, retry: RetryPolicy | None = None
) -> BinaryIO:
    """Open a chunk for reading: its decompressed bytes, as a binary file (a context manager).

    The compression comes from the suffix: ``.gz`` (with python-isal's igzip, else zlib-ng,
    else the standard library), ``.bz2``, ``.xz``, ``.zst`` (needs the ``zstd`` extra), any
    other suffix plain data. Data is streamed, never read whole.

    Args:
        ref: a local path, or a URL such as ``s3://bucket/key.gz`` (needs the ``remote``
            extra; see `list_chunks` for the protocols).
        storage_options: options of the fsspec file system for a URL (e.g.
            ``{"endpoint_url": ..., "key": ..., "secret": ...}``); ignored for local paths.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None). A
            failure in the middle re-opens the object and goes on at the same byte.

    Raises:
        ValueError: for an unsupported compression suffix (e.g. ``.lz4``), before any I/O.
        ChunkNotFoundError, ChunkAccessError, ChunkReadError: naming the chunk (missing,
            access refused, failed even after the retries).
        ChunkFormatError: from reading, for corrupt or truncated compressed data.
        MissingExtraError: naming the extra to install (``remote``, ``zstd``).
    """
    return open_stream(os.fspath(ref), Store.of(storage_options, retry))


def open_stream(name: str, store: Store) -> BinaryIO:
    """`open_chunk` of the chunk `name` in `store`."""
    codec = codec_for(name)
    raw = open_raw(name, store)
    if codec is None:
        return cast(BinaryIO, io.BufferedReader(raw, 1 << 18)) if is_url(name) else raw
    try:
        # Buffered, so that line iteration reads blocks rather than a byte per call.
        return cast(BinaryIO, io.BufferedReader(_Decompressed(name, codec, raw), 1 << 18))
    except BaseException:
        raw.close()
        raise


class _Decompressed(io.BufferedIOBase):
    """`codec`'s decompressed view of `raw`; decompression errors become ChunkFormatError
    naming the chunk. Closing it closes `raw`."""

    def __init__(self, ref: str, codec: Codec, raw: BinaryIO) -> None:
        self._ref, self._codec, self._raw = ref, codec, raw
        self._decoder: IO[bytes] | None = codec.reader(raw)  # reads nothing yet

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        decoder = self._open_decoder()
        return self._guard(lambda: decoder.read(-1 if size is None else size))

    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    def readinto(self, buffer: Any) -> int:
        decoder: Any = self._open_decoder()
        return self._guard(lambda: int(decoder.readinto(buffer)))

    def _open_decoder(self) -> IO[bytes]:
        if self._decoder is None:
            raise ValueError(f"{self._ref}: read from a closed chunk")
        return self._decoder

    def _guard(self, action: Callable[[], T]) -> T:
        try:
            return action()
        except ChunkError:
            raise
        except Exception as error:
            raise ChunkFormatError(
                f"{self._ref}: corrupt or truncated {self._codec.name} data "
                f"({type(error).__name__}: {error})"
            ) from error

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._decoder is not None:
                self._decoder.close()
        finally:
            self._decoder = None
            self._raw.close()
            super().close()
