"""Opening stored bytes: local files through the operating system, URLs through the
fsspec file system of a `Store`, with its retries.

An object read through an fsspec buffered file (s3fs, gcsfs, adlfs, HTTP) is fetched in
byte ranges by a `RangeReader` (concurrently for a large one) and kept in the local cache
if one is configured, as the store's `FetchOptions` say.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, BinaryIO, cast

from ._cache import ChunkCache
from ._cancellable import LoopFetch
from ._ranges import Fetch, RangeReader, fetch_range
from ._store import S3_PROTOCOLS, Store, is_url, protocol_of
from .errors import ChunkReadError
from .fetch_options import FetchOptions
from .retry import RetryPolicy, call_with_retries, error_codes, named_error


def open_raw(ref: str, store: Store) -> BinaryIO:
    """The stored bytes of `ref`, unbuffered for URLs (a buffer above them is the caller's).

    Raises:
        ChunkNotFoundError, ChunkAccessError, ChunkReadError: naming `ref`.
    """
    if not is_url(ref):
        try:
            return open(ref, "rb")
        except OSError as error:
            raise named_error(error, ref, "opening") from error
    options, policy = store.fetch, store.retry
    fs, path = store.filesystem(ref)
    cache = None
    if options.cache_dir is not None:
        cache = ChunkCache(os.fspath(options.cache_dir), options.cache_size)
        fs.invalidate_cache(path)  # the size and ETag now, not those of a listing
    file = store.call(lambda: fs.open(path, "rb"), ref, "opening")
    size = getattr(file, "size", None)
    if not callable(getattr(file, "_fetch_range", None)) or not isinstance(size, int):
        return cast(BinaryIO, RemoteRaw(fs, path, ref, policy, file))
    try:
        return _ranged(file, ref, size, options, cache, policy)
    except BaseException:
        file.close()
        raise


def _ranged(
    file: Any,
    ref: str,
    size: int,
    options: FetchOptions,
    cache: ChunkCache | None,
    policy: RetryPolicy | None,
) -> BinaryIO:
    """The bytes of the opened fsspec buffered `file`: from the cache if it holds them,
    else fetched in ranges (passing through the cache)."""
    version = _identity(file)[1]
    sink = None
    if cache is not None and version:
        entry = cache.path(ref, str(version), size)
        cached = cache.open(entry, size)
        if cached is not None:
            file.close()
            return cached
        sink = cache.writer(entry, size)
    concurrent = options.ranges_in_flight > 0 and size >= options.ranges_from_size
    fetch, cancel = _range_requests(file, ref)
    return cast(
        BinaryIO,
        RangeReader(
            fetch,
            ref,
            size,
            range_size=options.range_size if concurrent else max(1, int(file.blocksize)),
            in_flight=options.ranges_in_flight if concurrent else 0,
            policy=policy,
            expired=partial(_expired, ref, _identity(file)),
            sink=sink,
            release=file.close,
            cancel=cancel,
        ),
    )


def _range_requests(file: Any, ref: str) -> tuple[Fetch, Callable[[], None] | None]:
    """How the ranges of the opened fsspec buffered `file` are fetched, and how its requests
    in flight are cancelled: for s3fs, as tasks on its file system's event loop (a closed
    reader cancels them); else by ``_fetch_range(start, end)``, how every fsspec buffered
    file fetches bytes (its block caches call it), whose requests cannot be cancelled."""
    loop = getattr(file.fs, "loop", None)
    if protocol_of(ref) in S3_PROTOCOLS and isinstance(loop, asyncio.AbstractEventLoop):
        requests = LoopFetch(loop, partial(_s3_range, file, ref))
        return requests, requests.cancel
    return file._fetch_range, None


async def _s3_range(file: Any, ref: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the s3fs `file` `ref`, requested as its ``_fetch_range``
    does (its version; If-Match the ETag seen at opening, where s3fs sends it), with the
    ETag of the answer checked too (for stores that ignore If-Match)."""
    version = {"VersionId": file.version_id} if file.version_id else {}
    response = await file.fs._call_s3(
        "get_object",
        Bucket=file.bucket,
        Key=file.key,
        Range=f"bytes={start}-{end - 1}",
        **version,
        **getattr(file, "read_kw", {}),
    )
    body = response["Body"]
    try:
        identity = _identity(file)
        if identity[1] is not None and response.get("ETag", identity[1]) != identity[1]:
            raise _changed(ref, identity, f"ETag {response['ETag']}")
        return bytes(await body.read())
    finally:
        body.close()  # before its end: its connection is closed, not reused


def _expired(
    ref: str, identity: tuple[object, object], error: BaseException
) -> ChunkReadError | None:
    """The error for a range request refused because the object changed (its If-Match
    failed: s3fs's ``FileExpired``, or the ``PreconditionFailed`` of S3), else None."""
    if type(error).__name__ != "FileExpired" and "PreconditionFailed" not in error_codes(error):
        return None
    return _changed(ref, identity, "another ETag")


class RemoteRaw(io.RawIOBase):
    """The bytes of a remote object whose fsspec file cannot fetch byte ranges (``file://``,
    ``memory://``), from `file`, its first opening; a transient failure in the middle
    re-opens the object and goes on at the same byte (after the retry policy's wait), so
    that no byte is lost or repeated. A re-opened object must have the size and ETag it had
    at first."""

    def __init__(self, fs: Any, path: str, ref: str, policy: RetryPolicy | None, file: Any) -> None:
        self._fs, self._path, self._ref, self._policy = fs, path, ref, policy
        self._position = 0
        self._file: Any = file
        self._identity = _identity(file)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size: int = call_with_retries(
            lambda: self._read_once(buffer), self._ref, "reading", self._policy
        )
        self._position += size
        return size

    def _read_once(self, buffer: Any) -> int:
        if self._file is None:
            file = self._open()
            if _identity(file) != self._identity:
                file.close()
                raise _changed(self._ref, self._identity, _identity(file))
            file.seek(self._position)
            self._file = file
        try:
            return int(self._file.readinto(buffer))
        except BaseException:
            self._drop_file()
            raise

    def _open(self) -> Any:
        return self._fs.open(self._path, "rb")

    def _drop_file(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close
                file.close()

    def close(self) -> None:
        self._drop_file()
        super().close()


def open_random_access(ref: str, store: Store) -> BinaryIO:
    """The stored bytes of `ref` as a seekable file, for formats read in pieces (a Parquet
    footer, then column chunks): a local file, or for a URL a `SeekableRemoteFile`.

    Raises:
        ChunkNotFoundError, ChunkAccessError, ChunkReadError: naming `ref`.
    """
    if not is_url(ref):
        return open_raw(ref, store)
    fs, path = store.filesystem(ref)
    return cast(BinaryIO, SeekableRemoteFile(fs, path, ref, store.retry))


class SeekableRemoteFile(io.RawIOBase):
    """A remote object read by byte ranges: each ``read(n)`` at the current position is one
    request for exactly those bytes (``cat_file`` of its fsspec file system, through
    `fetch_range`: retried on its own, counted in `storage_counts`), so that a reader that
    seeks (Parquet, Arrow IPC) fetches only what it reads. The size (and the version:
    `version`) comes from one request at opening; `RangeReader` is the sequential,
    concurrent counterpart for whole-object streams."""

    def __init__(self, fs: Any, path: str, ref: str, policy: RetryPolicy | None) -> None:
        self._fs, self._path, self._ref, self._policy = fs, path, ref, policy
        self._position = 0
        info = call_with_retries(lambda: fs.info(path), ref, "opening", policy)
        self._size = int(info["size"])
        self.version = f"{self._size} {_version_of(info)}"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self._ref}: seek to {base + offset}, before the start")
        self._position = base + offset
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        if end <= start:
            return b""
        data = fetch_range(
            lambda first, stop: bytes(self._fs.cat_file(self._path, start=first, end=stop)),
            self._ref,
            self._policy,
            None,
            _never_expired,
            start,
            end,
        )
        self._position = end
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)


def _never_expired(error: BaseException) -> None:
    """No error of a whole-range request says the object changed: a short answer does."""
    return None


def file_version(file: BinaryIO) -> str | None:
    """What identifies the content of a file opened by `open_random_access`: its size and
    modification time (local) or ETag (an object); None where neither is known."""
    version = getattr(file, "version", None)
    if isinstance(version, str):
        return version if not version.endswith(" None") else None
    try:
        status = os.fstat(file.fileno())
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None
    return f"{status.st_size} {status.st_mtime_ns}"


def _version_of(info: Mapping[str, Any]) -> str | None:
    for key in ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return None


def _identity(file: Any) -> tuple[object, object]:
    """(size, ETag) of an opened fsspec file, where its file system reports them."""
    details = getattr(file, "details", None)
    if not isinstance(details, Mapping):
        return (getattr(file, "size", None), None)
    return (details.get("size"), details.get("ETag", details.get("etag")))


def _changed(ref: str, before: tuple[object, object], now: object) -> ChunkReadError:
    return ChunkReadError(
        f"{ref} changed while it was being read (size and ETag before: {before}, now: "
        f"{now}); read it again from its start"
    )
